"""Stale shared-memory files (NCCL, torch multiprocessing) in /dev/shm.

The seeds ran a blind `rm -f /dev/shm/psm_* /dev/shm/sem.mp-*`.  Here a file
matching the configured globs is removed only when no live process has it
open or mapped; every decision is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import fnmatch
import os
import stat
from pathlib import Path

from kimi_supervisor.config.model import ShmConfig
from kimi_supervisor.host.proctable import ProcessTable

F_SETLEASE = 1024  # fcntl.F_SETLEASE, which Python exposes only from 3.13 on some builds


@dataclasses.dataclass(frozen=True)
class ShmDecision:
    path: Path
    remove: bool
    reason: str  # why kept: "open by PID 123 (python3)"; or "unused"
    size: int


@dataclasses.dataclass(frozen=True)
class ShmOutcome:
    removed: tuple[Path, ...]
    kept: tuple[ShmDecision, ...]
    errors: tuple[str, ...]


def plan_shm(cfg: ShmConfig, table: ProcessTable) -> list[ShmDecision]:
    """Which matching files would be removed, and why the others are kept."""
    # /proc shows canonical paths: a directory given through a symlink or `..` (or /dev/shm being a
    # symlink to /run/shm) must be compared in that form, or no opener is ever found.
    directory = Path(os.path.realpath(cfg.directory))
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OSError(f"cannot list {directory}: {exc.strerror}") from None
    candidates = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in cfg.globs)]
    if not candidates:
        return []
    prefix = str(directory).rstrip("/") + "/"
    users = table.open_paths((prefix,))
    blind = _blind_reason(users.unreadable)
    decisions = []
    for name in candidates:
        path = directory / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            decisions.append(ShmDecision(path, False, "not a regular file", 0))
            continue
        openers = sorted(users.get(str(path), set()))
        if openers:
            who = ", ".join(_describe_pid(table, pid) for pid in openers[:5])
            more = f" and {len(openers) - 5} more" if len(openers) > 5 else ""
            decisions.append(ShmDecision(path, False, f"in use by {who}{more}", st.st_size))
        else:
            decisions.append(_unseen_openers(path, st.st_size, blind))
    return decisions


def remove_stale(decisions: list[ShmDecision]) -> ShmOutcome:
    removed: list[Path] = []
    errors: list[str] = []
    for d in decisions:
        if not d.remove:
            continue
        try:
            d.path.unlink()
            removed.append(d.path)
        except FileNotFoundError:
            continue  # someone else cleaned it: the goal is met
        except OSError as exc:
            errors.append(f"{d.path}: {exc.strerror}")
    return ShmOutcome(tuple(removed), tuple(d for d in decisions if not d.remove), tuple(errors))


def _unseen_openers(path: Path, size: int, blind: str) -> ShmDecision:
    """No opener in /proc: ask the kernel too, since /proc may hide some (unreadable, hidepid, other PID ns).

    The kernel grants a write lease only when no other open file description of the file exists, an
    fd or a mapping alike (exact since Linux 5.3), so its answer overrides an incomplete /proc scan;
    when it cannot answer and the scan was incomplete, the file is kept: deleting a live segment is
    data loss, keeping a stale one costs a few bytes.
    """
    free = write_lease_granted(path)
    if free is False:
        return ShmDecision(path, False, "in use by a process /proc does not show (a write lease was refused)", size)
    if free is None and blind:
        return ShmDecision(path, False, f"openers unknown, kept: {blind}", size)
    return ShmDecision(path, True, "no live process has it open or mapped", size)


def write_lease_granted(path: Path) -> bool | None:
    """True: nobody else has the file open or mapped (the kernel grants a write lease only then);
    False: somebody has; None: cannot tell (leases disabled, not the owner without CAP_LEASE, ...)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.fcntl(fd, F_SETLEASE, fcntl.F_WRLCK)
    except BlockingIOError:
        return False  # EAGAIN: another open file description (an fd or a mapping) exists
    except OSError:
        return None
    else:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
        return True
    finally:
        os.close(fd)


def _blind_reason(unreadable: dict[int, str]) -> str:
    """Fail closed: if any process's files could not be listed, it may be the one holding a candidate."""
    if not unreadable:
        return ""
    first = unreadable[min(unreadable)]
    more = f" (and {len(unreadable) - 1} more processes)" if len(unreadable) > 1 else ""
    return first + more


def _describe_pid(table: ProcessTable, pid: int) -> str:
    proc = table.get(pid)
    return f"PID {pid} ({proc.name})" if proc else f"PID {pid}"
