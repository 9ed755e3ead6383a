"""Deployment checks in isolation: model directory forms, GPU count, memory fraction, port."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from kimi_supervisor.gpu import GpuMemory
from kimi_supervisor.preflight.checks import Status, check_free_memory, check_gpu_count, check_model, check_port


def test_model_forms(tmp_path: Path) -> None:
    assert check_model(None).status is Status.FAIL
    hub = check_model("moonshotai/Kimi-K2.5")
    assert (hub.status, hub.message) == (
        Status.SKIP,
        "'moonshotai/Kimi-K2.5' is not a local path (a hub id?): not checked offline",
    )
    assert check_model(str(tmp_path)).message == f"{tmp_path} holds no *.safetensors file and no index"
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert check_model(str(tmp_path)).message == f"1 safetensors file(s) in {tmp_path}"
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    bad = check_model(str(tmp_path))
    assert bad.status is Status.FAIL and bad.message.startswith(
        f"{tmp_path / 'model.safetensors.index.json'}: unreadable shard index (JSONDecodeError"
    )
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model.safetensors"}}))
    assert check_model(str(tmp_path)).message == f"all 1 shards present (0.0 GB) in {tmp_path}"


def test_gpu_count_and_fraction() -> None:
    assert check_gpu_count(8, tuple(range(8)), 8).status is Status.OK
    assert check_gpu_count(8, (0, 1), 8).status is Status.FAIL
    ok = check_free_memory([GpuMemory(0, 97887, 0, 97887)], 0.95, {})
    assert ok.status is Status.OK
    short = check_free_memory([GpuMemory(0, 97887, 96619, 1268)], 0.95, {})
    assert short.message.endswith("GPU 0: 1268 MiB free < 92992 MiB (0.95 x 97887 MiB)")


def test_port_free_then_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert check_port("127.0.0.1", port).status is Status.OK
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        taken = check_port("127.0.0.1", port)
    assert taken.status is Status.FAIL and taken.data["port"] == port
    assert check_port("203.0.113.7", port).message == "--host 203.0.113.7 is not an address of this machine"
