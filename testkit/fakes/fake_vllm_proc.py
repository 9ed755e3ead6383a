"""Process primitives of the fake vLLM: who this process is, signals, sleeping, titles, children."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from types import FrameType

from testkit.procutil import set_comm

CHILD_GRACE_S = 2.0
POLL_S = 0.02
EXIT_LIFETIME = 3


class Stop(Exception):
    """Raised by pause()/check() when this process has to stop."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "signal" | "parent" | "lifetime"


class _Proc:
    """This process's identity: one per process, reset in each forked child."""

    label = "APIServer"
    pid = 0
    quiet = False
    stop_requested = False
    watch_parent = False
    parent_pid = 0
    deadline = float("inf")


P = _Proc()


def _on_term(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    P.stop_requested = True


def install_term(ignore: bool) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if ignore else _on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore else signal.SIG_DFL)


def check() -> None:
    if P.stop_requested:
        raise Stop("signal")
    if P.watch_parent and os.getppid() != P.parent_pid:
        raise Stop("parent")
    if time.monotonic() > P.deadline:
        raise Stop("lifetime")


def pause(seconds: float, step: float = POLL_S) -> None:
    """Sleep, checking for SIGTERM, parent death and the lifetime every `step` s."""
    end = time.monotonic() + max(0.0, seconds)
    while True:
        check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(step, left))


def set_cmdline(title: str) -> None:
    """Overwrite this process's argv area (what setproctitle does), best effort.

    /proc/PID/cmdline then reads TITLE, and psutil's name() returns the full TITLE instead of the
    15-byte comm.
    """
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
        size = end - start
        if size < 2:
            return
        text = title.encode()[: size - 2]
        # Title, NUL padding, and a non-NUL last byte: the kernel then reports the argv area up to
        # the first NUL (the setproctitle convention).
        buf = text + b"\0" * (size - len(text) - 1) + b" "
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            os.pwrite(fd, buf, start)
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        pass


def set_title(title: str) -> None:
    set_comm(title)
    set_cmdline(title)


def fork_child(label: str, title: str, *, close_fds: Sequence[int], orphan: bool, ignore_term: bool) -> int:
    """Fork; in the child take the new identity and signal handling, and return 0."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    P.label = label
    P.pid = os.getpid()
    P.stop_requested = False
    P.parent_pid = parent
    P.watch_parent = not orphan
    set_title(title)
    install_term(ignore_term)
    if orphan and not ignore_term:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return 0


def reap(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait for our children `pids`; return those still alive after timeout."""
    alive = list(pids)
    end = time.monotonic() + timeout
    while alive:
        for pid in list(alive):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                alive.remove(pid)
        if not alive or time.monotonic() >= end:
            break
        time.sleep(POLL_S)
    return alive


def stop_children(pids: Sequence[int], graceful: bool) -> None:
    """SIGTERM (then SIGKILL after a grace period) or SIGKILL our own children."""
    live = [p for p in pids if p > 0]
    if not live:
        return
    first = signal.SIGTERM if graceful else signal.SIGKILL
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first)
    left = reap(live, CHILD_GRACE_S if graceful else 1.0)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap(left, 1.0)


def send(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, data)
