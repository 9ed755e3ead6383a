"""Deployment checks in isolation: model directory forms, GPU count, memory fraction, port."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from kimi_supervisor.host.gpu import GpuMemory
from kimi_supervisor.preflight.checks import (
    Check,
    Verdict,
    check_free_memory,
    check_gpu_count,
    check_model,
    check_port,
)


def test_model_forms(tmp_path: Path) -> None:
    assert check_model(None).verdict is Verdict.FAIL
    hub = check_model("moonshotai/Kimi-K2.5")
    assert (hub.verdict, hub.message) == (
        Verdict.SKIP,
        "'moonshotai/Kimi-K2.5' is not a local path (a hub id?): not checked offline",
    )
    assert check_model(str(tmp_path)).message == f"{tmp_path} holds no *.safetensors file and no index"
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert check_model(str(tmp_path)).message == f"1 safetensors file(s) in {tmp_path}"
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    bad = check_model(str(tmp_path))
    assert bad.verdict is Verdict.FAIL and bad.message.startswith(
        f"{tmp_path / 'model.safetensors.index.json'}: unreadable shard index (JSONDecodeError"
    )
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model.safetensors"}}))
    assert check_model(str(tmp_path)).message == f"all 1 shards present (0.0 GB) in {tmp_path}"


def check_model_within(model: Path, fifo: Path, seconds: float = 5.0) -> Check:
    """check_model, failing the test instead of hanging it when the check waits for a writer on `fifo`."""
    result: list[Check] = []
    worker = threading.Thread(target=lambda: result.append(check_model(str(model))), daemon=True)
    worker.start()
    worker.join(seconds)
    blocked = worker.is_alive()
    if blocked:  # a writer that comes and goes gives the stuck open() end of file: nothing outlives the test
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(seconds)
    assert not blocked, f"check_model waited {seconds:g}s for a writer on {fifo}"
    return result[0]


def test_model_index_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    check = check_model_within(tmp_path, index)
    assert (check.verdict, check.message) == (
        Verdict.FAIL,
        f"{index}: unreadable shard index (is a FIFO, expected a regular file)",
    )


def test_model_index_through_a_symlink_is_read(tmp_path: Path) -> None:
    # A Hugging Face snapshot links each file to its blob: the target is what is checked and read.
    repo = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5"
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "index").write_text(json.dumps({"weight_map": {"a": "model.safetensors"}}))
    model = repo / "snapshots" / "0123abcd"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"x")
    index = model / "model.safetensors.index.json"
    index.symlink_to("../../blobs/index")
    assert check_model(str(model)).message == f"all 1 shards present (0.0 GB) in {model}"
    os.mkfifo(blobs / "fifo")
    index.unlink()
    index.symlink_to(blobs / "fifo")
    check = check_model_within(model, blobs / "fifo")
    assert check.message == f"{index}: unreadable shard index (is a FIFO, expected a regular file)"


def test_gpu_count_and_fraction() -> None:
    assert check_gpu_count(8, tuple(range(8)), 8).verdict is Verdict.OK
    assert check_gpu_count(8, (0, 1), 8).verdict is Verdict.FAIL
    ok = check_free_memory([GpuMemory(0, 97887, 0, 97887)], 0.95, {})
    assert ok.verdict is Verdict.OK
    short = check_free_memory([GpuMemory(0, 97887, 96619, 1268)], 0.95, {})
    assert short.message.endswith("GPU 0: 1268 MiB free < 92992 MiB (0.95 x 97887 MiB)")


def test_port_free_then_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert check_port("127.0.0.1", port).verdict is Verdict.OK
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        taken = check_port("127.0.0.1", port)
    assert taken.verdict is Verdict.FAIL and taken.data["port"] == port
    assert check_port("203.0.113.7", port).message == "--host 203.0.113.7 is not an address of this machine"
