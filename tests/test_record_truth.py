"""The record tells the truth (docs/operators-view.md): every way out leaves its exit code and a reason behind.

A run ended by something other than a SupervisorError (a GPU lost during the preflight, psutil.AccessDenied,
a bug) used to leave the state file in "stopping"/"preflight" and the history's run unfinished, so `status`
said "gone without a final state (killed?)" and the next start wrote "ended without recording an exit".
Fake-time lifecycle runs (testkit/fakes/lifecycle_world.py), each with its own runtime and state directories.
"""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from kimi_supervisor.cli import entry as cli
from kimi_supervisor.cli.status import gather, render_text
from kimi_supervisor.config import layout
from kimi_supervisor.exitcodes import ExitCode, exit_outcome
from kimi_supervisor.host.gpu import GpuUnavailable
from kimi_supervisor.opsview.history import load_history
from testkit.fakes.gpu import FakeGpu
from testkit.fakes.lifecycle import RaisingSink
from testkit.fakes.lifecycle_world import HEALTH_LINE, World, lifecycle_config, serving_world
from tests.lifecycle.test_lifecycle_exits import LostGpu


def _files(w: World) -> tuple[dict[str, Any], dict[str, Any]]:
    own = layout.of(w.cfg)
    state = json.loads((own.runtime / "state.json").read_text())
    history = json.loads((own.state / "history.json").read_text())
    return state, history


def _status_text(w: World) -> str:
    return render_text(gather(layout.of(w.cfg)), now=1e9)


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (psutil.AccessDenied(1, "x"), 70, "internal error (a bug; the traceback is in the journal): AccessDenied"),
        (ZeroDivisionError("a bug"), 70, "ZeroDivisionError: a bug"),
        (GpuUnavailable("GPU 0 memory: GPU is lost"), 10, "NVML lost a GPU or its driver: GPU 0 memory: GPU is lost"),
        (SystemExit(3), 3, "SystemExit(3)"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v)[:12],
)
def test_an_exit_while_serving_that_is_no_supervisor_error_is_recorded(
    tmp_path: Path, exc: BaseException, code: int, words: str
) -> None:
    w = serving_world(tmp_path, sink=RaisingSink(exc))
    for t in (2.0, 3.0, 4.0):
        w.say_at(t, HEALTH_LINE)
    with pytest.raises(type(exc)):
        w.run()
    assert exit_outcome(exc)[0] == code  # what cli.main returns for it (the same table)
    state, history = _files(w)
    assert state["phase"] == "failed" and state["exit_code"] == code
    assert words in state["status"] and words in state["last_failure"]["root_cause"]
    [run] = history["runs"]
    assert run["exit_code"] == code and words in run["root_cause"] and run["end"] is not None
    text = _status_text(w)
    assert "killed?" not in text and f"exit {code}" in text


def test_a_gpu_lost_during_the_preflight_is_recorded_as_exit_10(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path, preflight={"gpus": [0]}), probe=LostGpu([FakeGpu()]))
    with pytest.raises(GpuUnavailable):
        w.run()
    state, history = _files(w)
    assert (state["phase"], state["exit_code"]) == ("failed", 10)
    assert "Unknown Error (the GPU fell off the bus)" in state["last_failure"]["root_cause"]
    [run] = history["runs"]
    assert run["exit_code"] == 10 and "fell off the bus" in run["root_cause"]
    # The next start does not overwrite it with "ended without recording an exit".
    again = load_history(layout.of(w.cfg).state / "history.json")
    assert not again.runs[0].unfinished
    assert "killed?" not in _status_text(w)


def test_a_broken_pipe_is_recorded_as_the_exit_0_it_is(tmp_path: Path) -> None:
    w = serving_world(tmp_path, sink=RaisingSink(BrokenPipeError(32, "Broken pipe")))
    for t in (2.0, 3.0, 4.0):
        w.say_at(t, HEALTH_LINE)
    with pytest.raises(BrokenPipeError):
        w.run()
    state, history = _files(w)
    assert (state["phase"], state["exit_code"]) == ("stopped", 0)
    assert history["runs"][0]["exit_code"] == 0 and "BrokenPipeError" in history["runs"][0]["root_cause"]


def test_a_stop_request_is_still_recorded_as_a_clean_stop(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.signal_at(3.0, signal.SIGTERM)
    assert w.run() == 0
    state, history = _files(w)
    assert (state["phase"], state["exit_code"], state["last_failure"]) == ("stopped", 0, None)
    assert history["runs"][0]["exit_code"] == 0 and history["runs"][0]["root_cause"] is None


def test_cli_main_and_the_record_agree_on_the_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cli.main's own mapping (GpuUnavailable 10, a bug 70) is the one the record uses."""
    for exc, expected in ((GpuUnavailable("x"), 10), (RuntimeError("bug"), 70)):

        def boom(*args: object, exc: BaseException = exc) -> int:
            raise exc

        monkeypatch.setattr(cli, "_load", boom)
        monkeypatch.setattr("sys.stderr", io.StringIO())
        assert cli.main(["--config", str(tmp_path / "k.toml"), "--log-format", "json"]) == expected
        assert int(exit_outcome(exc)[0]) == expected == int(ExitCode(expected))
