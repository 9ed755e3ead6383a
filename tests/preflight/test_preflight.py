"""Preflight end to end over a fake GPU whose memory follows real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kimi_supervisor.checks import Verdict
from kimi_supervisor.clock import Clock, SystemClock
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import PreflightError
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.host.nvml import NvmlProbe
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import INVISIBLE_PID, FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.procutil import free_port
from tests.conftest import ProcSpawner


def make_cfg(tmp_path: Path, *, tp: int = 2, util: str = "0.9", model: Path | None = None, **preflight: Any) -> Config:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    argv = [
        "vllm",
        "serve",
        str(model or tmp_path),
        "--tensor-parallel-size",
        str(tp),
        "--gpu-memory-utilization",
        util,
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
    ]
    pf: dict[str, Any] = {
        "deadline_s": 20,
        "poll_interval_s": 1,
        "busy_log_interval_s": 5,
        "check_model": model is not None,
        "reap": {"grace_s": 1},
        "shm": {"directory": str(shm)},
    }
    pf.update(preflight)
    return parse_config({"child": {"argv": argv}, "preflight": pf}, tmp_path / "k.toml")


def run(cfg: Config, probe: GpuProbe, *, dry: bool, clock: Clock | None = None, log: RecordingLog | None = None) -> Any:
    return Preflight(cfg, probe, PsutilProcessTable(), clock or FakeClock(), log or RecordingLog()).run(dry_run=dry)


def statuses(report: Any) -> list[tuple[str, str]]:
    return [(c.name, c.verdict.value) for c in report.checks]


def test_clean_gpus_proceed(tmp_path: Path) -> None:
    probe = FakeGpuProbe([FakeGpu(), FakeGpu()])
    report = run(make_cfg(tmp_path), probe, dry=False)
    assert report.proceed
    assert statuses(report) == [
        ("gpus", "ok"),
        ("shutdown_timeouts", "ok"),
        ("gpu_retired_pages", "n/a"),  # an H200: row remapping replaced page retirement
        ("gpu_remapped_rows", "ok"),
        ("gpu_ecc", "ok"),
        ("gpu_pcie", "ok"),
        ("gpu_persistence", "ok"),
        ("gpu_clocks", "ok"),
        ("gpu_wait", "ok"),
        ("shm", "ok"),
        ("port", "ok"),
        ("gpu_memory_fraction", "ok"),
    ]


def test_stale_workers_are_reaped_and_memory_returns(tmp_path: Path, spawner: ProcSpawner) -> None:
    w0 = spawner.sleeper(title="VLLM::Worker_TP0")
    w1 = spawner.sleeper(title="VLLM::Worker_TP1")
    decoy = spawner.sleeper(title="VLLM::Worker_TP9")  # vLLM-looking, holds no GPU
    probe = FakeGpuProbe([FakeGpu(occupants={w0.pid: 90000}), FakeGpu(occupants={w1.pid: 90000})])
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "psm_old").write_bytes(b"")
    log = RecordingLog()
    # Real processes die in real time: this test needs the real clock.
    report = run(make_cfg(tmp_path), probe, dry=False, log=log, clock=SystemClock())

    assert report.proceed
    assert w0.wait(5) and w1.wait(5)  # both died (negative: by signal)
    assert decoy.poll() is None
    kills = log.events("preflight.kill")
    assert {(k["pid"], k["signal"]) for k in kills} == {(w0.pid, "SIGTERM"), (w1.pid, "SIGTERM")}
    assert kills[0]["used_mib"] == 90000 and kills[0]["name"] == "VLLM::Worker_TP"  # comm: 15 chars
    assert ("shm", "done") in statuses(report)
    assert not (tmp_path / "shm" / "psm_old").exists()


def test_non_matching_holder_waits_then_fails_naming_it(tmp_path: Path, spawner: ProcSpawner) -> None:
    trainer = spawner.sleeper(title="trainer")
    probe = FakeGpuProbe([FakeGpu(), FakeGpu(occupants={trainer.pid: 12000})])
    log = RecordingLog()
    clock = FakeClock()
    with pytest.raises(PreflightError) as info:
        run(make_cfg(tmp_path), probe, dry=False, clock=clock, log=log)
    assert info.value.message == (
        f"preflight failed: gpu_wait: GPUs still busy after 20.0s (preflight.deadline_s = 20): GPU 1: 12000 MiB "
        f"used by PID {trainer.pid} (trainer) 12000 MiB: not killed, does not match preflight.reap.names / "
        f"preflight.reap.cmdline"
    )
    assert trainer.poll() is None
    busy_logs = log.events("preflight.gpu_busy")
    assert [b["waited_s"] for b in busy_logs] == [5.0, 10.0, 15.0]
    assert all(b["gpu"] == 1 and b["used_mib"] == 12000 for b in busy_logs)


def test_memory_freed_while_waiting(tmp_path: Path) -> None:
    gpu = FakeGpu(hidden_used_mib=5000)
    clock = FakeClock()
    clock.at(7, lambda: setattr(gpu, "hidden_used_mib", 0))
    report = run(make_cfg(tmp_path, tp=1), FakeGpuProbe([gpu]), dry=False, clock=clock)
    wait = next(c for c in report.checks if c.name == "gpu_wait")
    assert wait.verdict is Verdict.OK and "waited 7.00s" in wait.message


def test_dry_run_kills_and_removes_nothing(tmp_path: Path, spawner: ProcSpawner) -> None:
    w0 = spawner.sleeper(title="VLLM::Worker_TP0")
    trainer = spawner.sleeper(title="trainer")
    probe = FakeGpuProbe(
        [
            FakeGpu(occupants={w0.pid: 80000}),
            FakeGpu(occupants={trainer.pid: 3000}),
            FakeGpu(occupants={INVISIBLE_PID: 2000}),
        ]
    )
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "nccl-x").write_bytes(b"")
    report = run(make_cfg(tmp_path, tp=3), probe, dry=True)

    assert not report.proceed
    assert w0.poll() is None and trainer.poll() is None
    assert (tmp_path / "shm" / "nccl-x").exists()
    by_name = {(c.name, c.verdict): c.message for c in report.checks}
    assert by_name[("reap", Verdict.KILL)].startswith(f"PID {w0.pid} (VLLM::Worker_TP) on GPU 0, 80000 MiB: ")
    wait = by_name[("gpu_wait", Verdict.WAIT)]
    assert f"GPU 1: 3000 MiB used > 1000 MiB by PID {trainer.pid} (trainer) 3000 MiB: not killed" in wait
    assert f"GPU 2: 2000 MiB used > 1000 MiB by PID {INVISIBLE_PID} 2000 MiB: not killed, NVML reports" in wait
    assert "GPU 0" not in wait  # reaping frees it
    assert by_name[("shm", Verdict.REMOVE)].endswith("nccl-x: no live process has it open or mapped")
    # GPU 0's 80000 MiB count as free: a real start would have reaped its holder first.
    assert by_name[("gpu_memory_fraction", Verdict.OK)] == "every GPU has >= 0.9 x total free after reaping"
    data = report.to_dict()
    assert data["proceed"] is False and json.dumps(data)


def test_nvml_unavailable_is_a_failed_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        # pynvml.NVMLError(code) returns the matching subclass, as the real library raises.
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    probe = NvmlProbe()  # the real probe's words, not a fake's
    report = run(make_cfg(tmp_path, tp=1), probe, dry=True)
    assert statuses(report)[0] == ("nvml", "failed")
    assert report.checks[0].message == "NVML unavailable: Driver Not Loaded (is the NVIDIA driver loaded?)"
    with pytest.raises(PreflightError, match="nvml: NVML unavailable: Driver Not Loaded"):
        run(make_cfg(tmp_path, tp=1), probe, dry=False)


def test_too_few_gpus_for_tensor_parallel(tmp_path: Path) -> None:
    report = run(make_cfg(tmp_path, tp=8), FakeGpuProbe([FakeGpu()] * 2), dry=True)
    gpus = report.checks[0]
    assert gpus.verdict is Verdict.FAIL
    assert gpus.message == (
        "--tensor-parallel-size 8 needs 8 GPUs but only 2 are available (NVML sees 2, preflight.gpus selects [0, 1])"
    )


def test_configured_gpu_missing(tmp_path: Path) -> None:
    report = run(make_cfg(tmp_path, tp=1, gpus=[0, 5]), FakeGpuProbe([FakeGpu()] * 2), dry=True)
    assert report.checks[0].message == "configured GPU(s) [5] do not exist: NVML sees 2 GPU(s)"


def test_memory_fraction_cannot_be_met(tmp_path: Path) -> None:
    # 1 GiB used is under the threshold of "free", but 0.99 x total is then impossible.
    probe = FakeGpuProbe([FakeGpu(total_mib=1000, base_used_mib=500)])
    report = run(make_cfg(tmp_path, tp=1, util="0.95", memory_threshold_mib=600), probe, dry=True)
    check = next(c for c in report.checks if c.name == "gpu_memory_fraction")
    assert check.verdict is Verdict.FAIL
    assert check.message.endswith("GPU 0: 500 MiB free < 950 MiB (0.95 x 1000 MiB)")


def test_model_shards_checked(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {f"w{i}": f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for i in (1, 2):
        (model / f"model-{i:05d}-of-00003.safetensors").write_bytes(b"\0" * 10)
    report = run(make_cfg(tmp_path, tp=1, model=model), FakeGpuProbe([FakeGpu()]), dry=True)
    check = next(c for c in report.checks if c.name == "model")
    assert check.message == (
        "1 of 3 shards named in model.safetensors.index.json are missing: model-00003-of-00003.safetensors"
    )
    (model / "model-00003-of-00003.safetensors").write_bytes(b"\0" * 10)
    report = run(make_cfg(tmp_path, tp=1, model=model), FakeGpuProbe([FakeGpu()]), dry=True)
    assert next(c for c in report.checks if c.name == "model").verdict is Verdict.OK


def test_failed_static_check_kills_nothing(tmp_path: Path, spawner: ProcSpawner) -> None:
    w0 = spawner.sleeper(title="VLLM::Worker_TP0")
    probe = FakeGpuProbe([FakeGpu(occupants={w0.pid: 80000})])
    with pytest.raises(PreflightError, match=r"model directory .* does not exist"):
        run(make_cfg(tmp_path, tp=1, model=tmp_path / "absent"), probe, dry=False)
    assert w0.poll() is None


def test_port_in_use_names_the_listener(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, tp=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.child.vllm.port))
        s.listen()
        report = run(cfg, FakeGpuProbe([FakeGpu()]), dry=True)
    port = next(c for c in report.checks if c.name == "port")
    assert port.verdict is Verdict.FAIL
    assert port.message.startswith(f"port {cfg.child.vllm.port} on 127.0.0.1 is already in use by PID {os.getpid()} (")


def test_an_engine_on_its_uds_socket_leaves_the_port_to_its_front(tmp_path: Path) -> None:
    """vLLM with --uds binds no TCP port: the front holding the public port is no reason to refuse its engine."""
    cfg = make_cfg(tmp_path, tp=1)
    vllm = dataclasses.replace(cfg.child.vllm, uds=str(tmp_path / "engine.sock"))
    cfg = dataclasses.replace(cfg, child=dataclasses.replace(cfg.child, vllm=vllm))
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.child.vllm.port))  # the front's
        s.listen()
        report = run(cfg, FakeGpuProbe([FakeGpu()]), dry=True)
    assert [c for c in report.checks if c.name == "port"] == []
    assert report.proceed


def test_cpu_deployment_skips_gpus(tmp_path: Path) -> None:
    probe = FakeGpuProbe([])
    report = run(make_cfg(tmp_path, tp=1, gpus=[]), probe, dry=False)
    assert report.proceed and probe.calls == 0
    assert statuses(report)[0] == ("gpus", "skip")
