"""The checkpoint fingerprint, vLLM 0.32's `hash_checkpoint` (weight_cache/protocol.py) redone: on real
safetensors files here, against vLLM's own function in tests/e2e/test_vllm_checkpoint.py."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from kimi_supervisor.host.checkpoint import CheckpointError, changed_shards, fingerprint
from testkit.safetensors_files import write_model, write_shard


def by_hand(paths: list[Path]) -> str:
    """vLLM's loop, written out: name, then the 8-byte length and the JSON header, sorted by base name."""
    h = hashlib.md5(usedforsecurity=False)
    for path in sorted(paths, key=lambda p: p.name):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        h.update(path.name.encode())
        h.update(raw[: 8 + n])
    return h.hexdigest()


def test_the_digest_is_vllms_over_the_indexed_shards(tmp_path: Path) -> None:
    shards = write_model(tmp_path / "m")
    write_shard(tmp_path / "m" / "consolidated.safetensors", {"x": ("F32", [4])})  # not in the index: ignored
    found = fingerprint(tmp_path / "m")
    assert found is not None
    assert found.digest == by_hand(shards)
    assert sorted(found.shards) == [p.name for p in shards]


def test_weight_bytes_do_not_count_headers_do(tmp_path: Path) -> None:
    shards = write_model(tmp_path / "m")
    before = fingerprint(tmp_path / "m")
    name, tensors = shards[1].name, {"layers.2.w": ("BF16", [8, 8]), "layers.2.b": ("F32", [8])}
    write_shard(shards[1], tensors, fill=7)  # new bytes, the same layout
    assert fingerprint(tmp_path / "m") == before
    write_shard(shards[1], {"layers.2.w": ("BF16", [8, 16]), "layers.2.b": ("F32", [8])})  # a reshaped tensor
    after = fingerprint(tmp_path / "m")
    assert before is not None and after is not None and after.digest != before.digest
    assert changed_shards(before.to_doc(), after) == f"header changed: {name}"


def test_without_a_local_checkpoint_there_is_no_fingerprint(tmp_path: Path) -> None:
    assert fingerprint("moonshotai/Kimi-K2.5") is None  # a Hub id: vLLM keys on the name itself
    assert fingerprint(None) is None
    (tmp_path / "empty").mkdir()
    assert fingerprint(tmp_path / "empty") is None


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda m: (m / "model-00002-of-00003.safetensors").unlink(), "names shards that are missing"),
        (lambda m: (m / "model-00001-of-00003.safetensors").write_bytes(b"\x01\x02"), "shorter than a safetensors"),
        (lambda m: (m / "model-00001-of-00003.safetensors").write_bytes(struct.pack("<Q", 1 << 40)), "more than"),
        (lambda m: (m / "model-00001-of-00003.safetensors").write_bytes(struct.pack("<Q", 64) + b"{}"), "cut short"),
        (lambda m: (m / "model.safetensors.index.json").write_text("[]"), "not a shard index"),
    ],
)
def test_an_unreadable_checkpoint_is_an_error_naming_the_file(tmp_path: Path, spoil: object, words: str) -> None:
    write_model(tmp_path / "m")
    spoil(tmp_path / "m")  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=words) as err:
        fingerprint(tmp_path / "m")
    assert str(tmp_path / "m") in str(err.value) and "\n" not in str(err.value)


def test_a_fifo_for_a_shard_is_refused_unopened(tmp_path: Path) -> None:
    shards = write_model(tmp_path / "m")
    shards[0].unlink()
    os.mkfifo(shards[0])  # opened for reading, it would block the start forever
    with pytest.raises(CheckpointError, match="is a FIFO, expected a regular file"):
        fingerprint(tmp_path / "m")


def test_changed_shards_names_new_gone_and_changed(tmp_path: Path) -> None:
    write_model(tmp_path / "m", shards=6)
    held = fingerprint(tmp_path / "m")
    assert held is not None
    doc = held.to_doc()
    doc["shards"] = {**doc["shards"], "model-00009-of-00006.safetensors": "00"}
    for n in ("model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors"):
        doc["shards"][n] = "ff"
    del doc["shards"]["model-00006-of-00006.safetensors"]
    assert changed_shards(doc, held, most=1) == (
        "header changed: model-00001-of-00006.safetensors and 1 more; new: model-00006-of-00006.safetensors; "
        "gone: model-00009-of-00006.safetensors"
    )
    assert json.loads(json.dumps(doc))  # what the state file holds is JSON
