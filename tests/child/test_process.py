"""Child: line splitting under abuse, environment hygiene, spawn errors, tree termination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from kimi_supervisor.child.process import ChildProcess, LineSplitter, SpawnSpec, child_environment
from kimi_supervisor.exitcodes import ExitCode, SpawnError
from kimi_supervisor.host.procident import alive, identify
from tests.conftest import REPO, close_pipes, wait_for


def spec(*argv: str, **kw: object) -> SpawnSpec:
    base: dict[str, object] = {"env": {}, "inherit_environment": True, "working_directory": None, "user": None}
    base.update(kw)
    return SpawnSpec(argv=tuple(argv), **base)  # type: ignore[arg-type]


class TestLineSplitter:
    def test_newlines_and_carriage_returns(self) -> None:
        s = LineSplitter()
        assert s.feed(b"a\nb") == ["a"]
        assert s.feed(b"c\r\nd\re\n") == ["bc", "d", "e"]
        assert s.close() == []

    def test_partial_line_flushed_on_close(self) -> None:
        s = LineSplitter()
        assert s.feed(b"no newline") == []
        assert s.close() == ["no newline"]

    def test_long_line_without_newline_is_cut_and_bounded(self) -> None:
        s = LineSplitter(max_line=1024)
        out = []
        for _ in range(1024):  # 1 MiB in 1 KiB chunks, no newline
            out += s.feed(b"x" * 1024)
        assert out == ["x" * 1024 + " [line cut: more than 1024 bytes]"]
        assert len(s._buf) == 0  # nothing accumulates while skipping
        assert s.feed(b"tail\nnext\n") == ["next"]

    def test_long_line_inside_one_chunk(self) -> None:
        s = LineSplitter(max_line=10)
        assert s.feed(b"short\n" + b"y" * 50 + b"\nok\n") == ["short", "y" * 10 + " [line cut: 50 bytes]", "ok"]

    def test_invalid_utf8_is_replaced_not_fatal(self) -> None:
        assert LineSplitter().feed(b"bad \xff\xfe bytes\n") == ["bad \ufffd\ufffd bytes"]


def test_child_environment_hides_supervisor_variables() -> None:
    parent = {
        "PATH": "/bin",
        "NOTIFY_SOCKET": "/run/x",
        "WATCHDOG_USEC": "1",
        "WATCHDOG_PID": "2",
        "JOURNAL_STREAM": "1:2",
        "KEEP": "yes",
    }
    env = child_environment(spec("x", env={"NCCL_PROTO": "LL"}), parent)
    assert env == {"PATH": "/bin", "KEEP": "yes", "NCCL_PROTO": "LL", "PYTHONUNBUFFERED": "1"}
    clean = child_environment(spec("x", inherit_environment=False), parent)
    assert clean == {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    ("kw", "argv0", "message"),
    [
        ({}, "/nonexistent/vllm", "cannot start child: child.argv[0]: '/nonexistent/vllm' not found"),
        (
            {"working_directory": "/nonexistent-dir"},
            sys.executable,
            "cannot start child: /nonexistent-dir: no such file or directory",
        ),
        (
            {"user": "no-such-user-kimi"},
            sys.executable,
            "cannot start child: child.user: no such user 'no-such-user-kimi' on this host",
        ),
        (
            {},
            "/dev/null",
            "cannot start child: child.argv[0]: /dev/null is not an executable file for the supervisor's user",
        ),
    ],
)
def test_spawn_errors(kw: dict[str, object], argv0: str, message: str) -> None:
    with pytest.raises(SpawnError) as info:
        ChildProcess.spawn(spec(argv0, **kw))
    assert info.value.message == message
    assert info.value.exit_code == ExitCode.SPAWN_FAILED


def _tree_script(ignore_term: bool, detach_grandchild: bool) -> str:
    return f"""
import os, signal, subprocess, sys, time
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
kids = [subprocess.Popen([sys.executable, '-c', 'import signal,time\\n'
                          + ('signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n' if {ignore_term} else '')
                          + 'time.sleep(600)']) for _ in range(2)]
if {detach_grandchild}:
    kids.append(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True))
print(' '.join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def _read_line(child: ChildProcess) -> str:
    fd = child.streams["stdout"]
    buf = b""
    deadline = time.monotonic() + 10
    while not buf.endswith(b"\n") and time.monotonic() < deadline:
        data = child.read(fd)
        if data:
            buf += data
        else:
            time.sleep(0.01)
    return buf.decode()


@pytest.mark.parametrize("ignore_term", [False, True])
def test_tree_is_terminated_including_detached_members(ignore_term: bool) -> None:
    child = ChildProcess.spawn(spec(sys.executable, "-c", _tree_script(ignore_term, detach_grandchild=True)))
    try:
        pids = [int(p) for p in _read_line(child).split()]
        idents = [identify(pid) for pid in pids]  # "gone" later means these processes, not whoever holds the PIDs
        members = {p.pid for p in child.refresh_members()}
        assert {child.pid, *pids} <= members  # the setsid'd grandchild too: it is a descendant
        child.signal_tree(signal.SIGTERM)
        if ignore_term:
            time.sleep(0.3)
            assert len(child.alive_members()) == 4
            child.signal_tree(signal.SIGKILL)
        wait_for(lambda: not child.alive_members(), timeout=10)
        assert child.poll() == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
        assert None not in idents and not [i for i in idents if i is not None and alive(i)]
    finally:
        for p in child.refresh_members():
            p.kill()
        close_pipes(child)


def test_signal_tree_never_touches_unrelated_processes() -> None:
    # The bystander shares this process's group and session: a signal to the wrong group reaches both.
    bystander = psutil.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child = ChildProcess.spawn(spec(sys.executable, "-c", "import time; time.sleep(600)"))
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        assert child.signal_tree(signal.SIGTERM) == 1  # the child, its only member
        wait_for(lambda: child.poll() is not None)
        assert child.poll() == -signal.SIGTERM
        # A signal a process sends to its own group is delivered before kill() returns, and Python runs
        # the handler at the next bytecode: a stray SIGTERM would be in `received` already.
        assert received == []
        assert bystander.is_running() and bystander.status() != psutil.STATUS_ZOMBIE
    finally:
        signal.signal(signal.SIGTERM, previous)
        bystander.kill()
        bystander.wait()
        close_pipes(child)


def in_a_new_pid_namespace(*args: str) -> dict[str, Any]:
    """tests/child/pid_reuse_scenario.py run as PID 1 of a PID namespace made for it; its last line's JSON."""
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False).returncode != 0:
        pytest.skip("no PID namespaces here (unshare --pid failed)")
    scenario = Path(__file__).with_name("pid_reuse_scenario.py")
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(scenario), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return got


def test_a_member_on_a_pid_an_earlier_member_had_is_still_signalled() -> None:
    """The tree remembers each member as (PID, start time). A member that exits and is reaped leaves its PID
    free; in a container's small PID namespace the tree's next process can get it. That new member is ours
    and must be signalled: with the old start time kept for the PID it was not (the pidfd check refused a
    process that is not the remembered one), and a member outside the child's session then outlived the
    SIGTERM. The reuse is made in a PID namespace this test creates (tests/child/pid_reuse_scenario.py)."""
    got = in_a_new_pid_namespace()
    assert got["first"] == got["second"]  # the premise: the new member has the old one's PID
    assert got["listed"]
    assert got["ended"], "the member on the reused PID outlived signal_tree(SIGTERM)"


def test_a_stranger_on_the_mains_pid_and_session_id_after_the_tree_went_is_never_a_member() -> None:
    """The tree is found by its session id too (members that left the main's process tree). That id is the main's
    PID: once the whole tree is gone and reaped, a process that gets the number and calls setsid() (every
    service systemd starts does) leads a session of that id, and a later stop's scan took it for a member and
    signalled it. Made in a PID namespace this test creates (ns_last_pid)."""
    got = in_a_new_pid_namespace("session")
    assert got["main"] == got["stranger"] == got["sid"]  # the premise: the main's PID and its session id
    assert not got["listed"], "a stranger leading a session of the main's id was listed as a member"
    assert not got["signalled"], "signal_tree reached a stranger"


def test_a_helper_the_supervisor_runs_itself_is_never_a_member_of_the_tree() -> None:
    """In the supervisor every child of its own counts (orphans of vLLM's tree come back to it, a subreaper), but
    not what it runs itself: a py-spy stuck in D state was SIGKILLed with the tree, outlived it and turned an exit
    14 into 22. The helper is in the supervisor's session, where no member of vLLM's tree can ever be."""
    child = ChildProcess.spawn(spec(sys.executable, "-c", "import time; time.sleep(600)"), owns_all_children=True)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as forensics runs py-spy
    try:
        assert helper.pid not in {p.pid for p in child.refresh_members()}
        assert helper.pid not in {p.pid for p in child.alive_members()}
        assert child.signal_tree(signal.SIGKILL) == 1  # vLLM's main only
        wait_for(lambda: child.poll() is not None)
        assert helper.poll() is None  # untouched
        helper.kill()
        wait_for(lambda: psutil.Process(helper.pid).status() == psutil.STATUS_ZOMBIE)
        child.reap()
        assert helper.wait(timeout=10) == -signal.SIGKILL  # its status was left to its own Popen (not ECHILD's 0)
    finally:
        helper.kill()
        helper.wait()
        close_pipes(child)
