"""The operator's view in-process: roles from a real process tree, per-GPU memory from a GpuProbe, the hooks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psutil
import pynvml
import pytest

from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.cli.status import gather, render_text
from kimi_supervisor.config import layout
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.host.gpu import GpuMemory, GpuUnavailable
from kimi_supervisor.host.nvml import NvmlProbe
from kimi_supervisor.lifecycle.machine import StateMachine
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.opsview.history import FILE_NAME as HISTORY_FILE
from kimi_supervisor.opsview.history import load_history
from kimi_supervisor.opsview.tree import classify
from kimi_supervisor.opsview.view import OBSERVE_EVERY_S, WRITE_EVERY_S, OperatorView
from kimi_supervisor.states import State
from testkit.fakes.clock import WALL_T0, FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle_world import TICK, ready_times, serving_world
from testkit.fakes.log import RecordingLog
from tests.conftest import ProcSpawner, wait_for

TREE = """
import subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
kids = [subprocess.Popen(sleep + [title]) for title in ("VLLM::EngineCore", "VLLM::Worker_TP1", "VLLM::Worker_TP0")]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


ROOT = 100


@pytest.mark.parametrize(
    ("pid", "name", "cmdline", "expected"),
    [
        (7, "VLLM::Worker_TP", "VLLM::Worker_TP3", ("worker", "Worker_TP3", 3)),
        (7, "VLLM::Worker_TP", "VLLM::Worker_PP1_TP2", ("worker", "Worker_PP1_TP2", 2)),
        (7, "VLLM::Worker", "VLLM::Worker", ("worker", "Worker", 0)),
        (7, "VLLM::EngineCor", "VLLM::EngineCore_DP0", ("engine_core", "EngineCore_DP0", None)),
        (7, "VLLM::EngineCor", "", ("engine_core", "EngineCore", None)),  # comm only: the cmdline was unreadable
        (ROOT, "python3", "vllm serve /m", ("api_server", "API server", None)),
        (7, "VLLM::APIServer", "VLLM::APIServer_1", ("api_server", "API server", None)),
        (7, "python3", "-c from multiprocessing.resource_tracker import main", ("resource_tracker",) * 2 + (None,)),
        (7, "sh", "sh -c true", ("other", "sh", None)),
    ],
)  # fmt: skip
def test_roles_from_names_and_cmdlines(
    pid: int, name: str, cmdline: str, expected: tuple[str, str, int | None]
) -> None:
    assert classify(pid, ROOT, name, cmdline) == expected


def config(tmp_path: Path, **extra: Any) -> Config:
    raw: dict[str, Any] = {
        "child": {"argv": ["vllm", "serve", "/m", "--tensor-parallel-size", "2"]},
        "preflight": {"gpus": [0, 1]},
        "paths": {"runtime_directory": str(tmp_path / "run"), "state_directory": str(tmp_path / "state")},
        "metrics": {"textfile": str(tmp_path / "k.prom")},
        **extra,
    }
    return parse_config(raw, tmp_path / "k.toml")


def test_tree_gpu_memory_health_watchdog_and_canary_reach_the_state_file(tmp_path: Path, spawner: ProcSpawner) -> None:
    root = spawner.python(TREE)
    assert root.stdout is not None
    engine, tp1, tp0 = (int(p) for p in root.stdout.readline().split())
    wait_for(lambda: len(psutil.Process(root.pid).children()) == 3)
    probe = FakeGpuProbe([FakeGpu(base_used_mib=500, occupants={tp0: 41234}), FakeGpu(occupants={tp1: 41230})])
    cfg = config(tmp_path)
    clock = FakeClock()
    clock.now = 5000.0  # one clock for the wall and monotonic times: every timestamp below is 5000 + t
    log = RecordingLog()
    tracker = ReadinessTracker(cfg.readiness)
    view = OperatorView(cfg, probe, log, tracker, watchdog_s=60.0, wall=clock.monotonic, mono=clock.monotonic)
    sent: list[dict[str, Any]] = []

    class Sink:
        def send(self, **fields: Any) -> None:
            sent.append(fields)

    notifier = view.tap(Sink())
    sm = StateMachine(notifier, log, observer=view)
    sm.enter_initial("preflight: checking")
    sm.to(State.STARTING, "starting: vLLM spawned", pid=root.pid)
    doc = json.loads((tmp_path / "run" / "k" / "state.json").read_text())
    assert [(p["pid"], p["role"], p["label"], p["gpus"]) for p in doc["processes"]] == [
        (root.pid, "api_server", "API server", []),
        (engine, "engine_core", "EngineCore", []),
        (tp0, "worker", "Worker_TP0", [{"index": 0, "used_mib": 41234}]),
        (tp1, "worker", "Worker_TP1", [{"index": 1, "used_mib": 41230}]),
    ]
    assert doc["gpus"] == [
        {"index": 0, "used_mib": 41734, "total_mib": 97887},
        {"index": 1, "used_mib": 41230, "total_mib": 97887},
    ]
    # Progress: the ETA appears in STATUS= once two shards give a rate.
    for t, line in ((0, "0/8"), (4, "2/8"), (8, "4/8")):
        clock.now = 5000.0 + t
        tracker.feed(f"Loading safetensors checkpoint shards:  0% Completed | {line} [00:00<?, ?it/s]")
        view.tick()
    assert view.eta_text(8.0) == "~8s left"
    clock.now += 1.0
    view.tick()
    loading = json.loads((tmp_path / "run" / "k" / "state.json").read_text())["loading"]
    assert loading == {
        "phase": "loading weights",
        "shards_done": 4,
        "shards_total": 8,
        "percent": 0,
        "elapsed_s": 9.0,
        "eta_s": 7.0,
        "eta_basis": "shard rate",
    }
    view.on_health(HealthResult(True, 200, None, clock.now, 0.0042))
    sm.to(State.READY, "ready: serving", notify={"READY": 1}, startup_s=9.5)
    notifier.send(WATCHDOG=1)
    view.on_canary(True, 0.84)
    clock.now += 1.0
    view.tick()
    doc = json.loads((tmp_path / "run" / "k" / "state.json").read_text())
    assert doc["phase"] == "ready" and doc["status"] == "ready: serving" and doc["ready_at"] == 5009.0
    assert doc["health"] == {"ok": True, "latency_s": 0.0042, "at": 5009.0, "error": None, "consecutive_failures": 0}
    assert doc["watchdog"] == {"enabled": True, "interval_s": 60.0, "last_ping_at": 5009.0, "pings": 1}
    assert doc["canary"] == {"ok": True, "latency_s": 0.84, "at": 5009.0}
    assert sent[-1] == {"WATCHDOG": 1}  # the tap passed it on
    prom = (tmp_path / "k.prom").read_text()
    gpu0 = 'kimi_supervisor_gpu_memory_used_at_start_bytes{deployment="k",gpu="0",role="engine"} 4.3761270784e+10'
    assert gpu0 in prom
    sm.to(State.STOPPING, "stopping: stop requested", notify={"STOPPING": 1})
    sm.to(State.FAILED, "failed: vLLM exited with status 1 after it was ready", exit_code=13)
    doc = json.loads((tmp_path / "run" / "k" / "state.json").read_text())
    assert doc["last_failure"] == {
        "at": 5010.0,
        "exit_code": 13,
        "root_cause": "vLLM exited with status 1 after it was ready",
    }
    [run] = json.loads((tmp_path / "state" / "k" / "history.json").read_text())["runs"]
    assert run["load_s"] == 9.5 and run["exit_code"] == 13 and run["post_weights_s"] is None
    assert log.events("operator_view.error") == []


def test_nvml_failure_is_shown_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    probe = NvmlProbe()  # the real probe's words
    cfg = config(tmp_path, preflight={"gpus": "all"})
    log = RecordingLog()
    view = OperatorView(cfg, probe, log, ReadinessTracker(cfg.readiness), None)
    sm = StateMachine(view.tap(type("N", (), {"send": lambda self, **f: None})()), log, observer=view)
    sm.enter_initial("preflight")
    sm.to(State.STARTING, "starting", pid=sys.maxsize)
    doc = json.loads((tmp_path / "run" / "k" / "state.json").read_text())
    assert doc["gpus"] == [] and "NVML unavailable" in doc["gpu_error"]
    assert doc["processes"] == []


# -- in the lifecycle's fake world: the view's times are the supervisor's injected clocks ---------------------

SHARDS = "(Worker_TP0 pid=3) INFO Loading safetensors checkpoint shards:  {pct}% Completed | {done}/8 [00:01<00:08]"


def test_the_views_elapsed_eta_and_uptime_follow_the_injected_clock(tmp_path: Path) -> None:
    # A load of 12 fake seconds, shards at 0/8 (1 s), 2/8 (5 s), 4/8 (9 s): 2 s a shard.  The whole run takes
    # milliseconds of real time, so each field below is what the fake clock says or the test fails (was: the
    # view read time.time and time.monotonic itself, and its elapsed and ETA were a few real ms).
    w = serving_world(tmp_path, started_at=12.0)
    for t, done in ((1.0, 0), (5.0, 2), (9.0, 4)):
        w.say_at(t, SHARDS.format(pct=done * 100 // 8, done=done))
    snaps: dict[float, dict[str, Any]] = {}
    rendered: dict[float, str] = {}

    def snap(t: float) -> None:
        snaps[t] = json.loads((layout.of(w.cfg).runtime / "state.json").read_text())
        rendered[t] = render_text(gather(layout.of(w.cfg)), now=w.clock.time())

    w.clock.at(10.5, lambda: snap(10.5))
    w.clock.at(42.0, lambda: snap(42.0))
    w.signal_at(45.0)
    assert w.run() == 0
    [ready] = ready_times(w)
    assert 12.0 <= ready < 12.0 + TICK

    loading = snaps[10.5]
    assert loading["phase"] == "starting" and loading["started_at"] == WALL_T0
    spawned = loading["spawned_at"] - WALL_T0
    assert 0 <= spawned < TICK  # the preflight takes no fake time
    # Written at most WRITE_EVERY_S ago, from an observation at most OBSERVE_EVERY_S older.
    assert 10.5 - WRITE_EVERY_S - OBSERVE_EVERY_S <= loading["updated_at"] - WALL_T0 <= 10.5
    lag = OBSERVE_EVERY_S + TICK
    elapsed = loading["loading"]["elapsed_s"]
    assert 10.5 - WRITE_EVERY_S - lag <= elapsed + spawned <= 10.5
    assert loading["loading"]["shards_done"] == 4 and loading["loading"]["eta_basis"] == "shard rate"
    # 4 shards left at 2 s each from the 4/8 line at 9 s, counted down to the observation (no last load yet).
    expected_eta = 4 * 2.0 - (spawned + elapsed - 9.0)
    assert abs(loading["loading"]["eta_s"] - expected_eta) <= 2 * lag, loading["loading"]

    served = snaps[42.0]
    assert served["phase"] == "ready" and served["loading"] is None
    assert served["ready_at"] == pytest.approx(WALL_T0 + ready)
    assert served["ready_at"] - served["spawned_at"] == pytest.approx(ready - spawned)
    # The tree from the injected process table: the fake vLLM, never whatever the host's PID 4242 is.
    assert [(p["pid"], p["role"]) for p in served["processes"]] == [(4242, "api_server")]
    # What `kimi-supervisor status` shows an operator at fake second 42.
    assert "Uptime: ready for 30s, load took 12s" in " ".join(rendered[42.0].split()), rendered[42.0]
    (run,) = load_history(layout.of(w.cfg).state / HISTORY_FILE).runs
    assert run.start == WALL_T0 and run.load_s == pytest.approx(ready - spawned, abs=1e-3)


class FlakyGpuProbe(FakeGpuProbe):
    """NVML that fails with `error` on memory() while it is set, as a transient driver error does."""

    error: str | None = None

    def memory(self, index: int) -> GpuMemory:
        if self.error is not None:
            raise GpuUnavailable(self.error)
        return super().memory(index)


def test_a_transient_nvml_error_is_one_warning_with_its_words_and_one_record_when_it_clears(tmp_path: Path) -> None:
    """The state file's `gpu_error` is replaced at the next refresh that works: without a record the journal would
    keep no trace of the error. One warning per kind of error when an outage begins (never error level, never per
    refresh: the view only reports), one info record when NVML answers again; a second outage of the same kind
    (NVML flapping) adds nothing."""
    probe = FlakyGpuProbe([FakeGpu(), FakeGpu()])
    cfg = config(tmp_path)
    clock = FakeClock()
    log = RecordingLog()
    view = OperatorView(cfg, probe, log, ReadinessTracker(cfg.readiness), None, wall=clock.time, mono=clock.monotonic)
    sm = StateMachine(view.tap(type("N", (), {"send": lambda self, **f: None})()), log, observer=view)
    sm.enter_initial("preflight")
    sm.to(State.STARTING, "starting", pid=sys.maxsize)
    state = tmp_path / "run" / "k" / "state.json"

    def refresh(error: str | None) -> dict[str, Any]:
        probe.error = error
        clock.now += 2.5  # past the starting refresh interval: this tick refreshes
        view.tick()
        return dict(json.loads(state.read_text()))

    lost = "GPU 1 memory: Unknown Error"
    for _ in range(3):
        assert refresh(lost)["gpu_error"] == lost
    assert refresh(None)["gpu_error"] is None
    refresh(lost)  # the same kind again: nothing new in the journal
    refresh(None)
    refresh("GPU 0 memory: GPU is lost")  # another kind: its own warning
    assert [(level, event, fields) for level, event, fields in log.records if event.startswith("operator_view")] == [
        ("warning", "operator_view.gpu_unreadable", {"error": lost}),
        ("info", "operator_view.gpu_readable", {"error": lost, "failed_refreshes": 3}),
        ("warning", "operator_view.gpu_unreadable", {"error": "GPU 0 memory: GPU is lost"}),
    ]
