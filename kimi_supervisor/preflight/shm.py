"""Stale shared-memory files (NCCL, torch multiprocessing) in /dev/shm.

The seeds ran a blind `rm -f /dev/shm/psm_* /dev/shm/sem.mp-*`.  Here a file
matching the configured globs is removed only when no live process has it
open or mapped; every decision is reported.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import stat
from pathlib import Path

from kimi_supervisor.config import ShmConfig
from kimi_supervisor.proctable import ProcessTable


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
    try:
        names = sorted(os.listdir(cfg.directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OSError(f"cannot list {cfg.directory}: {exc.strerror}") from None
    candidates = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in cfg.globs)]
    if not candidates:
        return []
    prefix = str(cfg.directory).rstrip("/") + "/"
    users = table.open_paths((prefix,))
    decisions = []
    for name in candidates:
        path = cfg.directory / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            decisions.append(ShmDecision(path, False, "not a regular file", 0))
            continue
        holders = sorted(users.get(str(path), set()))
        if holders:
            who = ", ".join(_describe_pid(table, pid) for pid in holders[:5])
            more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
            decisions.append(ShmDecision(path, False, f"in use by {who}{more}", st.st_size))
        else:
            decisions.append(ShmDecision(path, True, "no live process has it open or mapped", st.st_size))
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


def _describe_pid(table: ProcessTable, pid: int) -> str:
    proc = table.get(pid)
    return f"PID {pid} ({proc.name})" if proc else f"PID {pid}"
