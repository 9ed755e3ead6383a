"""The process-table boundary: who is running, what they hold open, signals.

Identity is (pid, create_time) so a recycled PID is never signalled by mistake.
A process counts as dead once every one of its threads is a zombie: a zombie
leader whose other threads still run may still hold GPU memory (measured on
an H200: /proc showed the leader Z at once while the driver released its
memory 90-210 ms after SIGTERM).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Protocol

import psutil

from kimi_supervisor.procfiles import OpenPaths, scan_open_paths
from kimi_supervisor.redact import redact_argv


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
    def command(self) -> str:
        """The command line for logs and reports: a stale server's --api-key never shows."""
        return " ".join(redact_argv(self.cmdline)) if self.cmdline else f"[{self.name}]"


class ProcessTable(Protocol):
    def get(self, pid: int) -> ProcInfo | None: ...

    def all(self) -> list[ProcInfo]: ...

    def open_paths(self, prefixes: tuple[str, ...]) -> OpenPaths: ...

    def alive(self, proc: ProcInfo) -> bool: ...

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool: ...


def exited(pid: int, proc_root: str = "/proc") -> bool:
    """True when `pid` is gone or every thread of it is a zombie (Z) or dead (X)."""
    try:
        tasks = os.listdir(f"{proc_root}/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"{proc_root}/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # that thread just went away
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        if state not in (b"Z", b"X"):
            return False
    return True


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

    def open_paths(self, prefixes: tuple[str, ...]) -> OpenPaths:
        """Paths starting with a prefix that a live process has open (fd) or mapped (maps); see procfiles."""
        return scan_open_paths(prefixes, self._proc)

    def alive(self, proc: ProcInfo) -> bool:
        try:
            p = psutil.Process(proc.pid)
            if abs(p.create_time() - proc.create_time) > 0.01:
                return False  # the PID was recycled: our process is gone
            return not exited(proc.pid, self._proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool:
        """Send `sig` if `proc` is still the same process; False when it is gone."""
        if not self.alive(proc):
            return False
        try:
            os.kill(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False


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
