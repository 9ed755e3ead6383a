"""Signals by identity: a pidfd for every kill (reaper and stop), killpg only while the leader is unreaped."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_supervisor.child.process import ChildProcess, SpawnSpec
from kimi_supervisor.clock import SystemClock
from kimi_supervisor.host import procident
from kimi_supervisor.host.gpu import GpuProcess
from kimi_supervisor.host.procident import ProcIdent, identify, send_signal
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.reaper import execute_reap, plan_reap
from tests.conftest import ProcSpawner, close_pipes, wait_for
from tests.preflight.test_kill_rules import reap_cfg


class SignalLog:
    """Records every signal the code sends, by route; kill(2) by bare PID is an error."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allow_kill: bool = False) -> None:
        self.pidfd: list[int] = []
        self.killpg: list[int] = []
        real_send, real_killpg, real_kill = signal.pidfd_send_signal, os.killpg, os.kill

        def pidfd_send(fd: int, sig: int, *a: object) -> None:
            self.pidfd.append(_pid_of(fd))
            real_send(fd, sig)

        def killpg(pgid: int, sig: int) -> None:
            self.killpg.append(pgid)
            real_killpg(pgid, sig)

        def kill(pid: int, sig: int) -> None:
            if not allow_kill:
                raise AssertionError(f"kill({pid}, {sig}) by bare PID")
            real_kill(pid, sig)

        monkeypatch.setattr(signal, "pidfd_send_signal", pidfd_send)
        monkeypatch.setattr(os, "killpg", killpg)
        monkeypatch.setattr(os, "kill", kill)


def _pid_of(fd: int) -> int:
    for line in open(f"/proc/self/fdinfo/{fd}").read().splitlines():  # noqa: SIM115
        if line.startswith("Pid:"):
            return int(line.split()[1])
    raise AssertionError("not a pidfd")


def test_recycled_identity_is_never_signalled(spawner: ProcSpawner, monkeypatch: pytest.MonkeyPatch) -> None:
    log = SignalLog(monkeypatch)
    victim = spawner.sleeper()
    ident = identify(victim.pid)
    assert ident is not None
    assert send_signal(ProcIdent(victim.pid, ident.create_time - 100), signal.SIGTERM) is False
    assert victim.poll() is None and log.pidfd == []
    assert send_signal(ident, signal.SIGTERM) is True
    assert victim.wait(5) == -signal.SIGTERM and log.pidfd == [victim.pid]
    assert send_signal(ident, signal.SIGTERM) is False  # gone (reaped): nothing to open


def test_without_pidfd_the_create_time_check_still_guards(
    spawner: ProcSpawner, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    log = SignalLog(monkeypatch, allow_kill=True)
    victim = spawner.sleeper()
    ident = identify(victim.pid)
    assert ident is not None
    assert send_signal(ProcIdent(victim.pid, ident.create_time + 5), signal.SIGKILL) is False
    assert victim.poll() is None
    assert send_signal(ident, signal.SIGKILL) is True
    assert victim.wait(5) == -signal.SIGKILL and log.pidfd == []


def test_reaper_kills_through_pidfds(spawner: ProcSpawner, monkeypatch: pytest.MonkeyPatch) -> None:
    table = PsutilProcessTable()
    worker = spawner.sleeper(title="VLLM::Worker_TP0")
    plan = plan_reap([GpuProcess(worker.pid, 0, 1000)], table, reap_cfg(), os.getpid())
    log = SignalLog(monkeypatch)
    outcome = execute_reap(plan, table, SystemClock(), 2.0, lambda v, s: None)
    assert [p.pid for p in outcome.terminated] == [worker.pid] and log.pidfd == [worker.pid]


TREE = (
    "import os, subprocess, sys, time\n"
    # A worker that leaves the group (setsid) and outlives the leader.
    "w = subprocess.Popen([sys.executable, '-c', 'import os, signal, time; os.setsid(); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(600)'], "
    "stdout=subprocess.PIPE)\n"
    "print(w.stdout.readline().decode().strip(), flush=True)\n"
    "time.sleep(600)\n"
)


def test_stop_signals_members_by_pidfd_and_the_group_only_while_its_leader_is_unreaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = ChildProcess.spawn(SpawnSpec((sys.executable, "-c", TREE), {}, True, None, None))
    worker = 0
    try:
        out = b""
        deadline = time.monotonic() + 10
        while not out.endswith(b"\n") and time.monotonic() < deadline:
            out += child.read(child.streams["stdout"]) or b""
            time.sleep(0.01)
        worker = int(out)
        wait_for(lambda: worker in {p.pid for p in child.refresh_members()})
        log = SignalLog(monkeypatch)
        assert child.signal_tree(signal.SIGTERM) == 2
        assert log.killpg == [child.pid]  # the leader is ours and unreaped: its group id is safe
        assert sorted(log.pidfd) == sorted([child.pid, worker])
        wait_for(lambda: child.poll() is not None)  # the leader is reaped now; the worker ignores TERM
        log.killpg.clear()
        log.pidfd.clear()
        assert child.signal_tree(signal.SIGKILL) == 1
        assert log.killpg == []  # its PID may name a stranger's group now
        assert log.pidfd == [worker]
        wait_for(lambda: procident.exited(worker))
    finally:
        close_pipes(child)
        if worker and not procident.exited(worker):
            subprocess.run(["kill", "-9", str(worker)], check=False)  # os.kill is patched to refuse here
