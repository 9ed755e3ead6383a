"""`status` shows a deployment's weight holder beside its engine: memory per GPU, uptime, loads served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_supervisor.cli.status import Snapshot, holder_summary, render_holder
from kimi_supervisor.opsview.history import HistoryData, RunRecord
from kimi_supervisor.roles import Role

NOW = 1_000_000.0


def snap(state: dict[str, Any] | None, runs: list[RunRecord], role: Role, running: bool = True) -> Snapshot:
    return Snapshot("kimi", running, "PID 7", state, Path("s"), HistoryData(runs=runs), Path("h"), None, role)


def test_holder_memory_per_gpu_uptime_and_loads_served() -> None:
    procs = [
        {"pid": 10, "label": "vllm preload", "gpus": []},
        {"pid": 11, "label": "vllm-weight-cache-target-0", "gpus": [{"index": 0, "used_mib": 72499}]},
        {"pid": 12, "label": "vllm-weight-cache-target-1", "gpus": [{"index": 1, "used_mib": 72501}]},
    ]
    holder_state = {"phase": "ready", "status": "ready", "ready_at": NOW - 3600, "processes": procs, "supervisor": {}}
    holder = snap(holder_state, [], Role.WEIGHTS)
    # Three engine runs: one before the holder was ready (a disk load), two that mapped its weights.
    runs = [RunRecord(NOW - 7200, 1, ready=NOW - 7000), RunRecord(NOW - 3000, 2, ready=NOW - 2990, end=NOW - 100)]
    runs.append(RunRecord(NOW - 90, 3, ready=NOW - 85))
    engine = snap({"phase": "ready"}, runs, Role.ENGINE)
    summary = holder_summary(holder, engine, NOW)
    assert summary == {"phase": "ready", "mib_by_gpu": {"0": 72499, "1": 72501}, "ready_for_s": 3600, "loads_served": 2}
    text = render_holder(holder, engine, NOW)
    assert "kimi-supervisor-weights@kimi - ready" in text
    assert text.endswith(
        "     Weights: holder ready, ready for 1h00m, 2 engine load(s) served; "
        "holds GPU 0: 72499 MiB, GPU 1: 72501 MiB\n"
    )


def test_a_stopped_holder_serves_nothing() -> None:
    holder = snap({"phase": "failed", "ready_at": NOW - 10}, [], Role.WEIGHTS, running=False)
    summary = holder_summary(holder, snap(None, [], Role.ENGINE, running=False), NOW)
    assert summary["phase"] == "not running" and summary["loads_served"] is None
