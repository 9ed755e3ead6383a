"""tests/run_errors.py: a failing test's report carries the traceback of its supervisors' error records."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from testkit.harness import REPO

# A Run as the harness keeps it (events as the supervisor logged them), without starting a supervisor: what is
# tested is the report, not the product.  The traceback is the one an in-place rewrite of the fake GPU file caused.
INNER = """
from testkit import harness

class FakeProc:
    pid = 4242

class FakeRun:
    proc = FakeProc()
    events = [
        {"event": "state.ready", "level": "info"},
        {"event": "operator_view.error", "level": "error", "method": "_refresh",
         "traceback": "Traceback (most recent call last):\\\\njson.decoder.JSONDecodeError: Expecting value: line 1"},
    ]

def test_fails_on_the_name_alone():
    harness.STARTED.append(FakeRun())
    assert [e["event"] for e in FakeRun.events if e["level"] == "error"] == []

def test_passes():
    harness.STARTED.append(FakeRun())
"""


def run_inner(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(INNER)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "tests.run_errors"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*argv, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_failing_test_shows_the_traceback_of_an_error_record(tmp_path: Path) -> None:
    result = run_inner(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "1 failed, 1 passed" in out, out
    # Shown once, for the failing test only, with the traceback's own lines, not just the event's name.
    assert out.count("kimi-supervisor error records") == 1, out
    assert 'supervisor PID 4242: {"event": "operator_view.error", "level": "error", "method": "_refresh"}' in out
    assert "json.decoder.JSONDecodeError: Expecting value: line 1" in out
    assert "state.ready" not in out.split("kimi-supervisor error records", 1)[1]
