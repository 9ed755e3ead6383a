"""Process identity: (pid, create time), and signals that can only reach that process.

A PID alone names whatever process holds it *now*; after the one we meant
exited and was reaped, the kernel may hand the number to an unrelated process.
So every kill in the supervisor (the preflight's reaper and the child tree's
stop) goes through `send_signal`, which opens a pidfd first and only then
checks the create time: once the pidfd is open it pins that exact process, so
a match after opening means the signal cannot reach a newcomer.  Kernels
before 5.3 (no pidfd_open) fall back to a create-time check right before
kill(2), which narrows the window to microseconds instead of closing it.

A process counts as exited once every one of its threads is a zombie: a zombie
leader whose other threads still run may still hold GPU memory (measured on an
H200: /proc showed the leader Z at once while the driver released its memory
90-210 ms after SIGTERM).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal

import psutil

# psutil derives create_time from /proc/PID/stat's start ticks and the boot time: two
# reads of one process agree to well under this; two processes a tick apart do not.
CREATE_TIME_TOLERANCE_S = 0.005


@dataclasses.dataclass(frozen=True)
class ProcIdent:
    pid: int
    create_time: float


def identify(pid: int) -> ProcIdent | None:
    """The identity of whatever process holds `pid` now; None if none does."""
    try:
        return ProcIdent(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def same_start(a: ProcIdent, b: ProcIdent) -> bool:
    """`a` and `b` name one process: the same PID, started at the same tick."""
    return a.pid == b.pid and abs(a.create_time - b.create_time) < CREATE_TIME_TOLERANCE_S


def same_process(ident: ProcIdent) -> bool:
    """True while `ident.pid` still names the process `ident` was taken from."""
    now = identify(ident.pid)
    return now is not None and same_start(now, ident)


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


def alive(ident: ProcIdent, proc_root: str = "/proc") -> bool:
    """The very process `ident` names is still running (some thread is not a zombie)."""
    return same_process(ident) and not exited(ident.pid, proc_root)


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for `pid`; None when this kernel or Python has none (the caller falls back)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None or not hasattr(signal, "pidfd_send_signal"):
        return None
    try:
        return int(opener(pid))
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):
            return None  # seccomp or an old kernel: fall back to the create-time check
        raise


def send_signal(ident: ProcIdent, sig: signal.Signals) -> bool:
    """Signal exactly the process `ident` names; False (nothing sent) when it is gone or recycled."""
    try:
        pidfd = _pidfd_open(ident.pid)
    except ProcessLookupError:
        return False
    except OSError:
        return False
    if pidfd is None:
        if not same_process(ident):
            return False
        try:
            os.kill(ident.pid, sig)
            return True
        except ProcessLookupError:
            return False
    try:
        # Checked after the pidfd is open: from here on the pidfd cannot follow a recycled PID.
        if not same_process(ident):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def group_signal(leader_unreaped: bool, pgid: int, sig: signal.Signals) -> bool:
    """killpg, but only while the group's leader is not yet reaped.

    An unreaped leader (running or zombie) keeps its PID, and so the group id,
    from being reused; once it is reaped and the group empties, the number can
    name a stranger's group.  Members are then signalled one by one instead.
    """
    if not leader_unreaped:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
