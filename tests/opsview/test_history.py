"""The run history: bounded, atomic, survives restarts, a corrupt file set aside and never fatal."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kimi_supervisor.opsview.history import KEEP, UNRECORDED, History, load_history
from testkit.fakes.log import RecordingLog


def test_rotation_keeps_the_last_20_runs_and_counts_every_start(tmp_path: Path) -> None:
    path = tmp_path / "history.json"
    for i in range(KEEP + 5):
        h = History(path, RecordingLog(), pid=1000 + i)
        h.begin(float(i))
        h.ready(i + 0.5, load_s=0.5, post_weights_s=0.1)
        h.end(i + 0.9, exit_code=13 if i % 2 else 0, root_cause="died" if i % 2 else None)
    data = load_history(path)
    assert len(data.runs) == KEEP == 20
    assert [r.start for r in data.runs] == [float(i) for i in range(5, KEEP + 5)]
    assert data.counters["starts_total"] == KEEP + 5
    assert data.runs[-1].exit_code == 0 and data.runs[-2].root_cause == "died"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"]  # no temporary file left behind


def test_counters_survive_restarts(tmp_path: Path) -> None:
    path = tmp_path / "history.json"
    for _ in range(3):
        h = History(path, RecordingLog(), pid=os.getpid())
        h.begin(1.0)
        h.count("preflight_kills_total", 2)
        h.count("shm_removed_total", 1)
    assert load_history(path).counters == {"starts_total": 3, "preflight_kills_total": 6, "shm_removed_total": 3}


def test_a_run_that_never_recorded_its_end_is_marked_at_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "history.json"
    History(path, RecordingLog(), pid=1).begin(1.0)  # then SIGKILLed: no end
    h = History(path, RecordingLog(), pid=2)
    h.begin(2.0)
    first, second = load_history(path).runs
    assert first.root_cause == UNRECORDED and first.exit_code is None and not first.unfinished
    assert second.unfinished


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"schema": 2, "runs": []}',
        '{"schema": 1, "runs": [{"start": "yesterday", "pid": 1}]}',
        '{"schema": 1, "runs": [], "counters": {"starts_total": -1}}',
        b"\xff\xfe",
    ],
)
def test_corrupt_history_is_set_aside_with_a_warning(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "history.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    log = RecordingLog()
    h = History(path, log, pid=7)
    h.begin(5.0)
    [warning] = log.events("history.corrupt")
    aside = Path(str(warning["set_aside_as"]))
    assert aside.name.startswith("history.json.corrupt-") and aside.exists()
    assert (aside.read_bytes() if isinstance(content, bytes) else aside.read_text()) == content
    data = json.loads(path.read_text())
    assert len(data["runs"]) == 1 and data["counters"]["starts_total"] == 1


def test_unwritable_history_warns_once_and_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = RecordingLog()
    h = History(blocker / "history.json", log, pid=1)
    h.begin(1.0)
    h.ready(2.0, 1.0, None)
    h.end(3.0, 0, None)
    assert len(log.events("history.unwritable")) == 1
