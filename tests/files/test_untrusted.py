"""Files read are untrusted (docs/fault-matrix.md): the state file and the history as hostile input.

A FIFO (or a link to /dev/zero) at history.json hung the daemon before the spawn (deaf to SIGTERM) and hung
`status`; deep nesting, 1e300 timestamps or wrong field types made `status` exit 70; vLLM's output (root
cause, STATUS= text, process titles) reached the operator's terminal with its escape sequences.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_supervisor.cli.status import gather, render_text, run_status
from kimi_supervisor.opsview.history import History, HistoryData, RunRecord, dump_history, load_history
from testkit.fakes.log import RecordingLog
from testkit.harness import REPO, Run, fake_config
from tests.cli.test_status import NOW, history, history_path, paths, setup, state_doc, state_path

ESC_TEXT = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\u202eevil\u2028\x9b1m\ud800"


def _printable_lines(text: str) -> bool:
    return all(line.isprintable() for line in text.split("\n"))


def _status(cfg: Path, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "status", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=timeout,
    )


# -- item 8: escapes ----------------------------------------------------------------


def test_status_escapes_every_control_character_it_prints(tmp_path: Path) -> None:
    doc = state_doc("ready", status=f"ready: {ESC_TEXT}", gpu_error=None)
    doc["processes"][0]["label"] = f"API {ESC_TEXT}"
    doc["last_failure"]["root_cause"] = f"cause {ESC_TEXT}"
    hist = history()
    hist.runs[1].root_cause = f"old {ESC_TEXT}"
    setup(tmp_path, doc, hist)
    text = render_text(gather(paths(tmp_path)), NOW)
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\x9b" not in text
    assert _printable_lines(text)
    assert "\\x1b]0;owned\\x07\\x1b[2J" in text and "\\u202e" in text and "\\ud800" in text
    assert f"ready: {ESC_TEXT}"[:6] in text  # the words are kept, only the controls are escaped
    # Not running: the history's cause (no state file), and --json escapes by construction.
    state_path(tmp_path).unlink()
    text = render_text(gather(paths(tmp_path)), NOW)
    assert "\x1b" not in text and "old \\x1b]0;owned" in text
    out = io.StringIO()
    run_status(setup(tmp_path, doc, hist), True, False, out=out)
    assert "\x1b" not in out.getvalue() and json.loads(out.getvalue())[0]["state"]["status"] == f"ready: {ESC_TEXT}"


def test_colours_are_ours_only(tmp_path: Path) -> None:
    doc = state_doc("ready", status=f"ready: {ESC_TEXT}")
    setup(tmp_path, doc, history())
    text = render_text(gather(paths(tmp_path)), NOW, color=True)
    # Every ESC left is one of our SGR colour codes.
    assert re.sub(r"\x1b\[(?:3[123]|[12]|0)m", "", text).count("\x1b") == 0


# -- item 9: odd files --------------------------------------------------------------


def _unblock(fifo: Path) -> None:
    """Open the FIFO's write end so that a reader stuck in open() (the unfixed code) gets EOF."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_at_history_json_does_not_block_the_daemon_and_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    fifo = tmp_path / "state" / "history.json"
    os.mkfifo(fifo, 0o666)
    hist = History(fifo, RecordingLog(), os.getpid())
    t = threading.Thread(target=hist.begin, args=(time.time(),), daemon=True)
    t.start()
    t.join(timeout=10)
    blocked = t.is_alive()
    if blocked:
        _unblock(fifo)
        t.join(timeout=5)
    assert not blocked, "History.begin blocked on a FIFO"
    aside = [p.name for p in (tmp_path / "state").iterdir() if p.name.startswith("history.json.corrupt-")]
    assert len(aside) == 1 and (tmp_path / "state" / aside[0]).is_fifo()  # set aside, not read, not removed
    assert json.loads(fifo.read_text())["runs"][0]["pid"] == os.getpid()  # a new history began


@pytest.mark.parametrize("kind", ["fifo", "dev_zero_link", "symlink_to_state"])
def test_status_never_hangs_on_odd_files(tmp_path: Path, kind: str) -> None:
    cfg = setup(tmp_path, None)
    targets = [state_path(tmp_path), history_path(tmp_path)]
    for target in targets:
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "dev_zero_link":
            target.symlink_to("/dev/zero")
        else:
            real = tmp_path / f"real-{target.name}"
            real.write_text(json.dumps(state_doc()))
            target.symlink_to(real)
    try:
        result = _status(cfg)
    finally:
        for target in targets:
            if kind == "fifo":
                _unblock(target)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "state file unreadable" in result.stdout and "expected a regular file" in result.stdout


def test_the_daemon_starts_past_a_fifo_at_history_json_and_stops_on_sigterm(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path)
    (tmp_path / "state" / "kimi").mkdir(parents=True)
    fifo = tmp_path / "state" / "kimi" / "history.json"
    os.mkfifo(fifo, 0o666)
    run = Run(cfg, tmp_path)
    try:
        warned = run.wait_event("history.corrupt", timeout=20)
        assert "expected a regular file" in str(warned["error"])
        run.wait_event("state.ready", timeout=30)
        run.signal(signal.SIGTERM)
        assert run.wait(30) == 0
    finally:
        _unblock(fifo)
        run.kill()


BAD_STATE: list[tuple[str, dict[str, Any]]] = [
    ("ended_at 1e300", {"ended_at": 1e300, "phase": "stopped"}),
    ("since 1e300", {"since": 1e300}),
    ("health latency a string", {"phase": "ready", "health": {"ok": True, "latency_s": "fast"}}),
    ("watchdog interval null", {"watchdog": {"enabled": True, "interval_s": None, "last_ping_at": 5}}),
    ("loading a list", {"loading": [1, 2]}),
    ("processes with a cycle", {"processes": [{"pid": 1, "ppid": 2, "label": "a"}, {"pid": 1, "label": "b"}]}),
    ("gpus of strings", {"gpus": ["x"]}),
    ("pid huge", {"supervisor": {"pid": 10**30, "start_time": 1.0}}),
    ("exit code a float", {"exit_code": 1.5}),
    ("last_failure a string", {"last_failure": "boom"}),
]


@pytest.mark.parametrize(("name", "over"), BAD_STATE, ids=[n for n, _ in BAD_STATE])
def test_a_state_file_with_odd_fields_is_a_note_not_a_crash(tmp_path: Path, name: str, over: dict[str, Any]) -> None:
    out = io.StringIO()
    rc = run_status(setup(tmp_path, state_doc(**over), history()), False, False, out=out, now=lambda: NOW)
    assert rc == 3  # not trusted, so not running as far as status can tell; never 70
    assert "state file unreadable" in out.getvalue()


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"schema": 1, "runs": [{"start": 1e300, "pid": 1}]}',
        '{"schema": 1, "runs": [{"start": 1, "pid": "one"}]}',
        '{"schema": 1, "runs": [{"start": 1, "pid": 1, "end": 1e999}]}',
        '{"schema": 1, "runs": [{"start": NaN, "pid": 1}]}',
        '{"schema": 1, "runs": [{"start": 1, "pid": 1, "exit_code": 1' + "0" * 5000 + "}]}",
        '{"schema": 1, "runs": [], "counters": {"starts_total": -1}}',
        '{"schema": 1, "runs": [], "counters": {"starts_total": true}}',
    ],
    ids=["deep", "start 1e300", "pid string", "end inf", "NaN", "5000 digits", "negative counter", "bool counter"],
)
def test_an_odd_history_is_set_aside_by_the_daemon_and_ignored_by_status(tmp_path: Path, text: str) -> None:
    cfg = setup(tmp_path, None)
    path = history_path(tmp_path)
    path.write_text(text)
    out = io.StringIO()
    assert run_status(cfg, False, False, out=out, now=lambda: NOW) == 3
    assert "history corrupt" in out.getvalue() and path.exists()  # status never renames
    warnings: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def warning(self, event: str, **fields: Any) -> None:
            warnings.append((event, fields))

    assert load_history(path, Log()).runs == []
    assert [e for e, _ in warnings] == ["history.corrupt"] and not path.exists()


# -- the fuzz test -------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=24,
)
STATE_KEYS = list(state_doc().keys())


def _mutated_state(data: st.DataObject) -> object:
    doc = state_doc(data.draw(st.sampled_from(["preflight", "starting", "ready", "stopping", "stopped", "failed"])))
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(STATE_KEYS))
        if isinstance(doc[key], dict) and doc[key] and data.draw(st.booleans()):
            doc[key][data.draw(st.sampled_from(list(doc[key])))] = data.draw(JSON)
        else:
            doc[key] = data.draw(JSON)
    return doc


def _mutated_history(data: st.DataObject) -> object:
    doc = json.loads(dump_history(HistoryData([RunRecord(start=1.0, pid=1, end=2.0, exit_code=1)])))
    run = doc["runs"][0]
    run[data.draw(st.sampled_from([*run, "extra"]))] = data.draw(JSON)
    if data.draw(st.booleans()):
        doc["counters"][data.draw(st.sampled_from([*doc["counters"], "x"]))] = data.draw(JSON)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_status_never_crashes_on_any_json(tmp_path: Path, data: st.DataObject) -> None:
    state = _mutated_state(data) if data.draw(st.booleans()) else data.draw(JSON)
    hist = _mutated_history(data) if data.draw(st.booleans()) else data.draw(JSON)
    cfg = setup(tmp_path, None)
    state_path(tmp_path).write_text(json.dumps(state))
    history_path(tmp_path).write_text(json.dumps(hist))
    for as_json in (False, True):
        out = io.StringIO()
        rc = run_status(cfg, as_json, False, out=out, now=lambda: NOW)
        assert rc in (0, 3)
        text = out.getvalue()
        if as_json:
            json.loads(text)
        assert _printable_lines(text.rstrip("\n"))
