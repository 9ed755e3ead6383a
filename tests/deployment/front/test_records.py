"""The front's one reader of its engine's records (kimi_supervisor/deployment/front/records.py): a state file counts
only while its writer runs; the phase and load ETA, the last load, the runs that ended in a window, the holder's
readiness; and the hold bound that the front and `--dry-run` both take from it (hold_bound)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.records import EnginePhase, EngineRecords, HoldBound, hold_bound
from kimi_supervisor.opsview.history import HistoryData, RunRecord, dump_history
from kimi_supervisor.opsview.statefile import StateFile, process_start_time
from testkit.fakes.log import RecordingLog

NOW = time.time()


def _state(path: Path, alive: bool = True, **fields: Any) -> Path:
    """A supervisor's state file; `alive=False`: its writer is gone (this PID is another process now: a start
    time 100 s off, as a recycled PID's)."""
    pid = os.getpid()
    started = process_start_time(pid)
    assert started is not None
    writer = {"pid": pid, "start_time": started if alive else started - 100, "version": "t", "config": ""}
    doc = {"schema": 1, "supervisor": writer, "phase": "ready", "status": "ready", "updated_at": NOW, **fields}
    assert StateFile(path.parent, RecordingLog(), path.name).write(doc)
    return path


def _history(path: Path, *runs: RunRecord) -> Path:
    path.write_bytes(dump_history(HistoryData(list(runs))))
    return path


def _ended(start: float, end: float, exit_code: int, load_s: float | None = None) -> RunRecord:
    return RunRecord(start=start, pid=1, ready=start + 1, load_s=load_s, end=end, exit_code=exit_code)


def test_a_live_writers_phase_and_load_eta_are_read(tmp_path: Path) -> None:
    path = _state(tmp_path / "state.json", phase="starting", loading={"eta_s": 41.2})
    assert EngineRecords(state_file=path).phase() == EnginePhase("starting", 41.2)
    _state(path, phase="ready")
    assert EngineRecords(state_file=path).phase() == EnginePhase("ready", None)


def test_a_dead_writers_state_file_is_ignored(tmp_path: Path) -> None:
    """Its phase ("stopping") would hold every request for an engine that nobody drains any more."""
    path = _state(tmp_path / "state.json", alive=False, phase="stopping", loading={"eta_s": 41.2})
    assert EngineRecords(state_file=path).phase() is None
    holder = _state(tmp_path / "state.weights.json", alive=False, ready_at=NOW - 50)
    assert not EngineRecords(holder_state_file=holder).holder_ready_by(NOW)


@pytest.mark.parametrize("content", [None, b"{not json", b'{"schema": 2}'])
def test_a_missing_or_unreadable_state_file_is_no_phase(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "state.json"
    if content is not None:
        path.write_bytes(content)
    assert EngineRecords(state_file=path).phase() is None
    assert EngineRecords().phase() is None


def test_the_holder_was_ready_by_a_time_only_from_its_ready_at_on(tmp_path: Path) -> None:
    holder = _state(tmp_path / "state.weights.json", ready_at=NOW - 50)
    records = EngineRecords(holder_state_file=holder)
    assert records.holder_ready_by(NOW)
    assert not records.holder_ready_by(NOW - 60)
    _state(holder, phase="starting", ready_at=NOW - 50)
    assert not records.holder_ready_by(NOW)


def test_the_runs_that_ended_in_a_window_and_the_last_load(tmp_path: Path) -> None:
    history = _history(
        tmp_path / "history.json",
        _ended(NOW - 500, NOW - 300, 0, load_s=9.0),
        _ended(NOW - 290, NOW - 100, 13, load_s=12.5),
        RunRecord(start=NOW - 90, pid=2),
    )
    records = EngineRecords(history_file=history)
    late, both = records.runs_ended(NOW - 150, NOW), records.runs_ended(NOW - 400, NOW)
    assert late is not None and both is not None
    assert ([r.exit_code for r in late], [r.exit_code for r in both]) == ([13], [0, 13])
    assert records.runs_ended(NOW - 50, NOW) == []
    assert records.last_load_s() == 12.5
    nothing = EngineRecords(history_file=tmp_path / "none.json")
    assert nothing.runs_ended(0, NOW) is None  # no history: the outage's kind is "unknown", not "no restart"
    assert nothing.last_load_s() is None and EngineRecords().last_load_s() is None


def test_the_hold_bound_says_where_it_came_from(tmp_path: Path) -> None:
    def cfg(**settings: Any) -> FrontConfig:
        return FrontConfig(host="127.0.0.1", port=0, engine_socket=tmp_path / "engine.sock", **settings)

    history = tmp_path / "history.json"
    assert hold_bound(cfg(engine_history_file=history)) == HoldBound(120.0, "no engine history yet")
    _history(history, _ended(NOW - 500, NOW - 300, 0, load_s=600.0))
    assert hold_bound(cfg(engine_history_file=history)) == HoldBound(630.0, "the engine's last load 600s + 30s")
    assert hold_bound(cfg(engine_history_file=history, hold_s=45.0)) == HoldBound(45.0, "front.hold_s")
