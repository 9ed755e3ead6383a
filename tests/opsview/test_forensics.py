"""An incident's evidence: real py-spy on a real process, a hanging dumper bounded by the budget, rotation, modes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kimi_supervisor.opsview import forensics
from kimi_supervisor.opsview.forensics import Incident, IncidentStore, PySpyDumper, StackDump, dump_stacks
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from tests.conftest import wait_for

SLEEPER = """
import sys, time
def stuck_in_a_known_function():
    print("up", flush=True)
    time.sleep(600)
stuck_in_a_known_function()
"""


def record(
    store: IncidentStore,
    dumper: object,
    procs: list[tuple[int, str]],
    log: RecordingLog,
    budget_s: float = forensics.BUDGET_S,
    ras: tuple[str, int] | None = None,
) -> str:
    clock = FakeClock()
    scene = forensics.Scene(
        "vLLM answers /health but its engine is wedged",
        17,
        procs,
        FakeGpuProbe([FakeGpu(base_used_mib=70000)]),
        (0,),
        (clock.monotonic() - 2.5, 3.0),
        ras,
    )
    path = forensics.record(
        store,
        scene,
        lambda: (dumper, "test dumper"),  # type: ignore[arg-type,return-value]
        clock=clock.monotonic,
        wall=clock.time,
        log=log,
        budget_s=budget_s,
    )
    assert path is not None
    return path


def test_real_py_spy_names_the_function_a_real_process_sleeps_in(tmp_path: Path) -> None:
    found = forensics.find_pyspy()
    if found is None:
        pytest.skip("py-spy is not installed (the dev and forensics extras install it)")
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        log = RecordingLog()
        path = record(IncidentStore(tmp_path / "incidents"), PySpyDumper(found), [(proc.pid, "python3")], log)
        doc = json.loads(Path(path).read_text())
        [dump] = doc["stacks"]
        if dump["text"] is None and "ermission" in (dump["error"] or ""):
            pytest.skip(f"ptrace refused here: {dump['error']}")
        assert "stuck_in_a_known_function" in dump["text"], dump
        assert doc["exit_code"] == 17 and doc["gpus"][0]["memory"]["used_mib"] == 70000
        assert (
            doc["gpus"][0]["activity"]["sm_clock_mhz"] == 1980 and "remapped_rows_pending" in doc["gpus"][0]["health"]
        )
        assert doc["metrics"] == {"running_plus_waiting": 3.0, "age_s": 2.5}
        assert log.events("incident.saved")[0]["stacks"] == "1/1"
    finally:
        proc.kill()
        proc.wait()


class Hanging:
    """Answers for one PID at once, never for the other (a py-spy stuck on a process in D state)."""

    def __init__(self, hangs: int) -> None:
        self.hangs = hangs
        self.release = threading.Event()

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]:
        if pid == self.hangs:
            self.release.wait(60)
            return "too late", None
        return f"Thread {pid}: busy_loop", None


def test_a_dumper_that_hangs_delays_the_stop_by_at_most_the_budget(tmp_path: Path) -> None:
    dumper = Hanging(hangs=2)
    try:
        log = RecordingLog()
        path = record(IncidentStore(tmp_path / "i"), dumper, [(1, "api"), (2, "EngineCore")], log, budget_s=0.5)
        doc = json.loads(Path(path).read_text())
        # The capture ended while the hanging dump still hangs (it returns only once released, in 60 s): the
        # budget ended it, whatever this machine's speed; its timings are recorded, the budget waited out.
        assert not dumper.release.is_set()
        assert doc["stacks_s"] >= 0.5 and doc["seconds"] >= doc["stacks_s"]
        fast, slow = doc["stacks"]
        assert fast["text"] == "Thread 1: busy_loop" and fast["seconds"] is not None
        assert slow["text"] is None and slow["error"] == "no answer within the 0.5s budget" and slow["seconds"] is None
        assert log.events("incident.stacks_missing")[0]["processes"] == 1  # one line, not a failure
    finally:
        dumper.release.set()


def test_no_py_spy_is_one_line_and_the_rest_is_kept(tmp_path: Path) -> None:
    log = RecordingLog()
    path = record(IncidentStore(tmp_path / "i"), None, [(1, "api")], log)
    doc = json.loads(Path(path).read_text())
    assert doc["stacks"] == [] and doc["gpus"][0]["index"] == 0
    assert [e["why"] for e in log.events("incident.no_stacks")] == ["test dumper"]


def test_a_missing_tool_is_found_nowhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    dumper, note = forensics.default_dumper()
    assert dumper is None and note.startswith("py-spy not found on PATH or beside")
    tool = tmp_path / "py-spy"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert forensics.find_pyspy() == str(tool)


def incident(at: float, size: int = 0) -> Incident:
    stacks = [StackDump(1, "x", 0.1, "y" * size, None)] if size else []
    return Incident(at, "wedged", 17, stacks, 0.1, "test", [], None)


def test_the_oldest_are_rotated_out_by_count_and_by_total_size(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "incidents", keep=3, max_total_bytes=10_000_000)
    paths = [store.save(incident(1_700_000_000 + i * 60)) for i in range(5)]
    assert store.files() == paths[2:]
    small = IncidentStore(tmp_path / "sized", keep=10, max_total_bytes=5000)
    sized = [small.save(incident(1_700_000_000 + i * 60, size=2000)) for i in range(4)]
    assert small.files() == sized[2:]  # two of ~2 KB fit under 5 KB
    big = small.save(incident(1_700_100_000, size=9000))
    assert small.files() == [big]  # the newest always stays, even alone over the bound


def test_files_are_0600_in_a_0700_directory_even_one_made_looser_before(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "incidents"
    directory.mkdir(parents=True, mode=0o755)
    os.chmod(directory, 0o755)
    path = IncidentStore(directory).save(incident(time.time()))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()


def test_a_planted_link_at_the_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "incidents").symlink_to(elsewhere)
    with pytest.raises(OSError):
        IncidentStore(tmp_path / "state" / "incidents").save(incident(time.time()))
    assert list(elsewhere.iterdir()) == []


def test_dump_stacks_of_nothing_takes_nothing() -> None:
    assert dump_stacks([], Hanging(0)) == ([], 0.0)


def test_py_spy_is_asked_not_to_pause_vllm_and_its_refusal_is_one_line(tmp_path: Path) -> None:
    tool = tmp_path / "py-spy"
    tool.write_text('#!/bin/sh\necho "$@"\n')
    tool.chmod(0o755)
    assert PySpyDumper(str(tool)).dump(4242, 5.0) == ("dump --nonblocking --pid 4242\n", None)
    refusal = "Error: Failed to get stack traces\n\nCaused by:\n    0: EPERM: Operation not permitted\n"
    tool.write_text(f"#!/bin/sh\nprintf '{refusal}' >&2\nexit 1\n")
    assert PySpyDumper(str(tool)).dump(4242, 5.0) == (
        None,
        "py-spy exited 1: Error: Failed to get stack traces Caused by: 0: EPERM: Operation not permitted",
    )
    tool.write_text("#!/bin/sh\nexec sleep 30\n")
    text, error = PySpyDumper(str(tool)).dump(4242, 0.2)
    assert text is None and error == "py-spy gave no answer within 0.2s"


def test_a_dump_that_never_returns_leaves_no_thread_the_interpreters_exit_would_join(tmp_path: Path) -> None:
    """The dumps and the RAS query run in daemon threads: a ThreadPoolExecutor's are joined when the interpreter
    exits, so one dump that never returned (py-spy on a process in D state) kept the supervisor from exiting."""
    dumper = Hanging(hangs=2)
    try:
        log = RecordingLog()
        record(IncidentStore(tmp_path / "i"), dumper, [(1, "api"), (2, "EngineCore")], log, 0.2, ("127.0.0.1", 1))
        left = [t for t in threading.enumerate() if t.name.startswith("forensics") and t.is_alive()]
        assert left, "the premise: the hanging dump's thread is still running"
        assert all(t.daemon for t in left), [(t.name, t.daemon) for t in left]
    finally:
        dumper.release.set()


def test_a_py_spy_that_outlives_sigkill_does_not_hold_the_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A py-spy reading a process stuck in the NVIDIA driver can itself be stuck there: its SIGKILL stays pending.
    Made here by not delivering SIGKILL at all; `subprocess.run` then waited for it without a bound after its
    timeout.  The dump answers once its time is up and a daemon thread reaps the py-spy whenever it goes."""
    tool = tmp_path / "py-spy"
    tool.write_text("#!/bin/sh\nexec sleep 600\n")
    tool.chmod(0o755)
    real_kill = os.kill
    withheld: list[int] = []

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            withheld.append(pid)  # stuck in the kernel: pending, never acted on
            return
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    answers: list[tuple[str | None, str | None]] = []
    dumping = threading.Thread(target=lambda: answers.append(PySpyDumper(str(tool)).dump(4242, 0.2)), daemon=True)
    dumping.start()
    try:
        wait_for(lambda: answers, timeout=30)  # the dump answered; without the fix it waits out the sleep
        assert answers == [(None, "py-spy gave no answer within 0.2s")]
        [pid] = withheld  # it was SIGKILLed, and the kill did not land
        reaper = [t for t in threading.enumerate() if t.name == f"forensics-reap-{pid}"]
        assert reaper and reaper[0].daemon
    finally:
        monkeypatch.undo()
        for pid in withheld:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        dumping.join(30)
