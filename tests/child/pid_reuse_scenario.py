"""Run as PID 1 of a PID namespace a test created (tests/child/test_process.py): a member of a ChildProcess's
tree exits and a new member of the same tree is put on its PID (ns_last_pid); both left the child's session,
so only the per-member signal reaches them.  Prints one JSON line: the two PIDs and whether the second member
was ended by signal_tree(SIGTERM) within the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from kimi_supervisor.child.process import ChildProcess, SpawnSpec
from kimi_supervisor.host.procident import alive, identify

# The child: a member in a session of its own on start and on each SIGUSR1, its PID on stdout; it reaps them.
MAIN = (
    "import signal, subprocess, sys\n"
    "kids = []\n"
    "def spawn(*_):\n"
    "    kids.append(subprocess.Popen(['sleep', '600'], start_new_session=True))\n"
    "    print(kids[-1].pid, flush=True)\n"
    "signal.signal(signal.SIGUSR1, spawn)\n"
    "signal.signal(signal.SIGCHLD, lambda *_: [k.poll() for k in kids])\n"
    "spawn()\n"
    "while True:\n"
    "    signal.pause()\n"
)
BOUND_S = 10.0


def line(child: ChildProcess) -> int:
    fd = child.streams["stdout"]
    buf = b""
    deadline = time.monotonic() + BOUND_S
    while not buf.endswith(b"\n"):
        assert time.monotonic() < deadline, f"no line from the child within {BOUND_S} s: {buf!r}"
        buf += child.read(fd) or b""
        time.sleep(0.005)
    return int(buf)


def until(what: str, check: object) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {BOUND_S} s")
        time.sleep(0.005)


def main() -> None:
    spec = SpawnSpec(
        argv=(sys.executable, "-c", MAIN), env={}, inherit_environment=True, working_directory=None, user=None
    )
    child = ChildProcess.spawn(spec)
    first = line(child)
    first_ident = identify(first)
    assert first_ident is not None
    assert first in {p.pid for p in child.refresh_members()}  # remembered with its start time
    os.kill(first, signal.SIGKILL)
    until("the first member reaped", lambda: not os.path.exists(f"/proc/{first}"))
    # Start times count clock ticks: the second member starts a tick later at least, whatever the machine's speed.
    until("a clock tick", lambda: time.time() > first_ident.create_time + 0.02)
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(first - 1))
    os.kill(child.pid, signal.SIGUSR1)
    second = line(child)
    second_ident = identify(second)
    assert second_ident is not None
    members = {p.pid for p in child.refresh_members()}
    child.signal_tree(signal.SIGTERM)
    deadline = time.monotonic() + BOUND_S
    while alive(second_ident) and time.monotonic() < deadline:
        time.sleep(0.01)
    ended = not alive(second_ident)
    child.signal_main(signal.SIGKILL)
    print(json.dumps({"first": first, "second": second, "listed": second in members, "ended": ended}), flush=True)


def session() -> None:
    """The whole tree exits and is reaped; a stranger then gets the main's PID and, as a session leader
    (setsid: what systemd does for every service it starts), the main's session id.  Prints whether the tree
    listed it and whether signal_tree(SIGTERM) reached it."""
    spec = SpawnSpec(
        argv=(sys.executable, "-c", "pass"), env={}, inherit_environment=True, working_directory=None, user=None
    )
    child = ChildProcess.spawn(spec)
    main_ident = identify(child.pid)
    assert main_ident is not None
    child.refresh_members()  # the main remembered, as a running supervisor would have it
    until("the main's exit", lambda: child.poll() is not None)
    child.reap()
    until("a clock tick", lambda: time.time() > main_ident.create_time + 0.02)
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(child.pid - 1))
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        sid = os.getsid(stranger.pid)
        listed = stranger.pid in {p.pid for p in child.refresh_members()}
        child.signal_tree(signal.SIGTERM)
        spared = stranger.poll() is None and stranger.returncode is None
        ended = False
        try:
            stranger.wait(timeout=0.5)  # a SIGTERM sent is delivered before kill() returns; this only collects it
            ended = True
        except subprocess.TimeoutExpired:
            pass
        print(
            json.dumps(
                {
                    "main": child.pid,
                    "stranger": stranger.pid,
                    "sid": sid,
                    "listed": listed,
                    "signalled": ended or not spared,
                }
            ),
            flush=True,
        )
    finally:
        stranger.kill()
        stranger.wait()


if __name__ == "__main__":
    session() if sys.argv[1:] == ["session"] else main()
