"""The process-table boundary: who is running, what they hold open, signals.

Identity is (pid, create_time), and every signal goes through
`procident.send_signal` (a pidfd), so a recycled PID is never signalled.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Protocol

import psutil

from kimi_supervisor.host.procfiles import OpenPaths, scan_open_paths
from kimi_supervisor.host.procident import ProcIdent, exited, send_signal
from kimi_supervisor.host.procident import alive as ident_alive
from kimi_supervisor.host.procstate import ProcState, read_state
from kimi_supervisor.redact import redact_argv

__all__ = ["ProcInfo", "ProcessTable", "PsutilProcessTable", "ancestors", "exited"]


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    name: str
    cmdline: tuple[str, ...]
    uid: int
    sid: int
    create_time: float

    @property
    def ident(self) -> ProcIdent:
        return ProcIdent(self.pid, self.create_time)

    @property
    def command(self) -> str:
        """The command line for logs and reports: a stale server's --api-key never shows."""
        return " ".join(redact_argv(self.cmdline)) if self.cmdline else f"[{self.name}]"


class ProcessTable(Protocol):
    def get(self, pid: int) -> ProcInfo | None: ...

    def all(self) -> list[ProcInfo]: ...

    def descendants(self, pid: int) -> list[ProcInfo]: ...  # every live process under `pid`, not `pid` itself

    def open_paths(self, prefixes: tuple[str, ...]) -> OpenPaths: ...

    def alive(self, proc: ProcInfo) -> bool: ...

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool: ...

    def cgroup(self, pid: int) -> str | None: ...

    def state(self, pid: int) -> ProcState | None: ...  # kernel state, wait channel, stack (procstate.py)


def _info(p: psutil.Process) -> ProcInfo | None:
    try:
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE and exited(p.pid):
                return None
            try:
                sid = os.getsid(p.pid)
            except OSError:
                sid = -1
            return ProcInfo(
                pid=p.pid,
                ppid=p.ppid(),
                name=p.name(),
                cmdline=tuple(p.cmdline()),
                uid=p.uids().real,
                sid=sid,
                create_time=p.create_time(),
            )
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


class PsutilProcessTable:
    """ProcessTable over psutil and /proc."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc = proc_root

    def get(self, pid: int) -> ProcInfo | None:
        try:
            return _info(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return None

    def all(self) -> list[ProcInfo]:
        return [i for i in (_info(p) for p in psutil.process_iter()) if i is not None]

    def descendants(self, pid: int) -> list[ProcInfo]:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [i for i in (_info(p) for p in children) if i is not None]

    def open_paths(self, prefixes: tuple[str, ...]) -> OpenPaths:
        """Paths starting with a prefix that a live process has open (fd) or mapped (maps); see procfiles."""
        return scan_open_paths(prefixes, self._proc)

    def alive(self, proc: ProcInfo) -> bool:
        return ident_alive(proc.ident, self._proc)

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool:
        """Send `sig` if `proc` is still the same process (pidfd); False when it is gone."""
        return self.alive(proc) and send_signal(proc.ident, sig)

    def state(self, pid: int) -> ProcState | None:
        return read_state(pid, self._proc)

    def cgroup(self, pid: int) -> str | None:
        """The process's cgroup v2 path (or the name=systemd v1 one), e.g. /system.slice/x.service."""
        try:
            with open(f"{self._proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return None
        found = None
        for line in lines:
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                found = found or path
            elif controllers == "name=systemd":
                found = path
        return found


def ancestors(table: ProcessTable, pid: int) -> set[int]:
    """`pid` and every ancestor up to PID 1: never candidates for a kill."""
    seen = {pid, 1, 0}
    current = table.get(pid)
    while current is not None and current.ppid not in seen:
        seen.add(current.ppid)
        current = table.get(current.ppid)
    if current is not None:
        seen.add(current.ppid)
    return seen
