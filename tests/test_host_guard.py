"""The host path guard (tests/host_guard.py) fails a run that touches a protected path, and only then.

Each test runs a tiny suite in a subprocess with the guard pointed at scratch directories standing in for
/run/kimi-supervisor, /var/lib/kimi-supervisor, /etc/systemd/system and /dev/shm: the real host paths are
never written, not even here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.host.procident import ProcIdent, send_signal
from testkit.harness import REPO
from tests.host_guard import SETTLE_S, HostPathGuard


def run_suite(
    tmp_path: Path, body: str, existing: dict[str, str] | None = None, tag: str = "inner"
) -> subprocess.CompletedProcess[str]:
    """A one-test suite whose test runs `body` (with RUN, STATE, UNITS, SHM: the fake protected paths)."""
    fake = {name: tmp_path / "host" / name.lower() for name in ("RUN", "STATE", "UNITS", "SHM")}
    fake["SHM"].mkdir(parents=True)
    fake["UNITS"].mkdir()
    for rel, text in (existing or {}).items():
        target = tmp_path / "host" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    suite = tmp_path / "suite"
    suite.mkdir()
    prologue = "".join(f"{name} = {str(path)!r}\n" for name, path in fake.items())
    code = "import os, pathlib, subprocess, sys, time\n" + prologue + "\n\ndef test_it():\n"
    code += "".join(f"    {line}\n" for line in body.splitlines())
    (suite / "test_inner.py").write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KIMI_HOST_GUARD_PATHS": os.pathsep.join(str(fake[n]) for n in ("RUN", "STATE", "UNITS")),
        "KIMI_HOST_GUARD_SHM": str(fake["SHM"]),
        "KIMI_TEST_SESSION": tag,
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "tests.host_guard"]
    return subprocess.run([*argv, str(suite)], capture_output=True, text=True, env=env, cwd=suite, timeout=120)


def test_a_clean_suite_passes(tmp_path: Path) -> None:
    # Reads are fine, and so is what already existed before the run (a service, or `bash .ci/setup`).
    result = run_suite(tmp_path, "assert os.listdir(STATE) == ['history.json']", {"state/history.json": "[]"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "host path guard" not in result.stdout


@pytest.mark.parametrize(
    ("body", "named"),
    [
        # The failures: the port lock and state file in the runtime directory, the history.
        ("os.makedirs(RUN); pathlib.Path(RUN, 'port-8000.lock').write_text('1')", "created: {RUN}/port-8000.lock"),
        ("pathlib.Path(STATE, 'history.json').write_text('[1]')", "changed: {STATE}/history.json"),
        ("pathlib.Path(UNITS, 'kimi-supervisor.service').write_text('x')", "created: {UNITS}/kimi-supervisor.service"),
        ("os.remove(os.path.join(STATE, 'history.json'))", "removed: {STATE}/history.json"),
    ],
    ids=["runtime_directory", "state_directory", "unit_directory", "removed"],
)
def test_a_suite_that_touches_a_protected_path_fails_naming_it(tmp_path: Path, body: str, named: str) -> None:
    result = run_suite(tmp_path, body, {"state/history.json": "[]"})
    host = tmp_path / "host"
    expected = named.format(RUN=host / "run", STATE=host / "state", UNITS=host / "units")
    assert "1 passed" in result.stdout, result.stdout  # the test itself passed: the guard failed the run
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert "host path guard" in result.stdout and expected in result.stdout, result.stdout


def test_same_size_same_second_rewrite_of_our_unit_is_caught(tmp_path: Path) -> None:
    # Our unit's contents count, not only its mtime: the rewrite keeps size and mtime.
    body = (
        "p = pathlib.Path(UNITS, 'kimi-supervisor.service'); st = p.stat()\n"
        "p.write_text('[Unit]\\nB\\n'); os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    result = run_suite(tmp_path, body, {"units/kimi-supervisor.service": "[Unit]\nA\n"})
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert f"changed: {tmp_path / 'host' / 'units' / 'kimi-supervisor.service'}" in result.stdout


def test_shm_files_of_ours_left_behind_fail_and_held_or_foreign_ones_do_not(tmp_path: Path) -> None:
    pidfile = tmp_path / "holder.pid"
    body = (
        "pathlib.Path(SHM, 'psm_left').write_text('x')\n"  # ours, orphaned: flagged
        "pathlib.Path(SHM, 'someone-else').write_text('x')\n"  # not a name our tests create: not ours to judge
        "held = os.path.join(SHM, 'sem.mp-held'); pathlib.Path(held).write_text('x')\n"
        # Held open by a live process that outlives the session (another suite's vLLM, say): still in use.
        "code = 'import sys, time; f = open(sys.argv[1]); print(1, flush=True); time.sleep(60)'\n"
        "p = subprocess.Popen([sys.executable, '-c', code, held], stdout=subprocess.PIPE, start_new_session=True)\n"
        "assert p.stdout.readline() == b'1\\n'\n"
        # The PID with its create time: by the time the outer test kills it the holder may be gone, its PID reused.
        "import psutil\n"
        f"pathlib.Path({str(pidfile)!r}).write_text(f'{{p.pid}} {{psutil.Process(p.pid).create_time()!r}}')"
    )
    result = run_suite(tmp_path, body)
    shm = tmp_path / "host" / "shm"
    try:
        assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
        assert f"left behind: {shm / 'psm_left'}" in result.stdout
        assert "someone-else" not in result.stdout and "sem.mp-held" not in result.stdout, result.stdout
    finally:
        if pidfile.exists():  # the holder the inner test started, by its identity, never a PID alone
            pid, created = pidfile.read_text().split()
            send_signal(ProcIdent(int(pid), float(created)), signal.SIGKILL)


def test_nspawn_directories_count_only_with_this_sessions_tag(tmp_path: Path) -> None:
    # A second suite on the same CI machine boots its own containers in the same /dev/shm: their directories
    # carry that suite's tag, and they are that suite's to judge.  Ours, left behind, still fail the run.
    body = (
        "tag = os.environ['KIMI_TEST_SESSION']\n"
        "os.mkdir(os.path.join(SHM, f'kimi-nspawn-{os.getpid()}-{tag}-ours'))\n"
        "os.mkdir(os.path.join(SHM, f'kimi-nspawn-{os.getpid()}-othersuite-theirs'))"
    )
    result = run_suite(tmp_path, body, tag="thissuite")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
    assert "-thissuite-ours" in result.stdout and "theirs" not in result.stdout, result.stdout


def test_a_shm_file_unlinked_while_the_guard_looks_is_not_left_behind_and_one_that_stays_is(tmp_path: Path) -> None:
    """multiprocessing's resource tracker unlinks a semaphore just after its owner let go (a second suite's vLLM
    beside this one makes such files): seen unheld at the session's end, gone a moment later. The guard waits
    for that moment, bounded; a file that stays unheld past the bound is still left behind."""
    shm = tmp_path / "shm"
    shm.mkdir()
    now = [0.0]
    unlinked_at_first_pause = shm / "sem.mp-passing"

    def pause(seconds: float) -> None:
        unlinked_at_first_pause.unlink(missing_ok=True)  # its owner's tracker, while the guard waits
        now[0] += seconds

    guard = HostPathGuard((), str(shm), "tag", clock=lambda: now[0], pause=pause)
    guard.start()
    unlinked_at_first_pause.write_text("x")
    (shm / "psm_leaked").write_text("x")
    assert guard.problems() == [f"left behind: {shm / 'psm_leaked'}"]
    assert now[0] >= SETTLE_S  # the leak was given the whole bound to go
