"""Reaping stale GPU processes: decide who may die, then TERM, poll, KILL.

Only a process that holds a CUDA context on a configured GPU (NVML lists it)
and matches the kill rules is a victim.  Merely having /dev/nvidia* open
(nvidia-persistenced, DCGM, monitoring agents, this supervisor after
nvmlInit) never makes a process a candidate.  PID 1, the supervisor and its
ancestors, and protected names are never signalled.  A victim's stale tree
may take along its companions (the multiprocessing resource_tracker) and
ancestors that match the same rules.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import signal
from collections.abc import Callable, Iterable

from kimi_supervisor.clock import Clock
from kimi_supervisor.config import ReapConfig
from kimi_supervisor.gpu import GpuProcess
from kimi_supervisor.proctable import ProcessTable, ProcInfo, ancestors

COMM_LEN = 15


@dataclasses.dataclass(frozen=True)
class Victim:
    proc: ProcInfo
    gpus: tuple[int, ...]
    used_mib: int | None  # summed over GPUs; None when NVML would not say
    why: str  # "holds a CUDA context", "companion of PID n", "parent of PID n"
    mib_by_gpu: tuple[tuple[int, int], ...] = ()  # what NVML says it holds on each GPU


@dataclasses.dataclass(frozen=True)
class Spared:
    pid: int
    gpus: tuple[int, ...]
    used_mib: int | None
    proc: ProcInfo | None  # None: NVML's PID is not visible in this namespace
    reason: str


@dataclasses.dataclass(frozen=True)
class ReapPlan:
    victims: tuple[Victim, ...]
    spared: tuple[Spared, ...]


@dataclasses.dataclass(frozen=True)
class ReapOutcome:
    terminated: tuple[ProcInfo, ...]  # died after SIGTERM
    killed: tuple[ProcInfo, ...]  # needed SIGKILL
    survivors: tuple[ProcInfo, ...]  # alive even after SIGKILL (D state, other namespace)
    seconds: float


class KillRules:
    """The configured rules as predicates over ProcInfo."""

    def __init__(self, cfg: ReapConfig) -> None:
        self._cfg = cfg

    def _names(self, proc: ProcInfo) -> list[str]:
        names = [proc.name]
        if proc.cmdline:
            # setproctitle rewrites argv; the first word is the full title.
            first = proc.cmdline[0].split(" ")[0]
            names += [first, os.path.basename(first)]
        return names

    def _any_name(self, proc: ProcInfo, patterns: tuple[str, ...]) -> bool:
        return any(_name_matches(n, pat) for n in self._names(proc) for pat in patterns)

    def protected(self, proc: ProcInfo) -> bool:
        return self._any_name(proc, self._cfg.protected_names)

    def matches(self, proc: ProcInfo) -> bool:
        command = _command(proc)
        return self._any_name(proc, self._cfg.names) or any(rx.search(command) for rx in self._cfg.cmdline)

    def companion(self, proc: ProcInfo) -> bool:
        command = _command(proc)
        return any(rx.search(command) for rx in self._cfg.companions)


def _command(proc: ProcInfo) -> str:
    return " ".join(proc.cmdline).replace("\n", " ")


def _name_matches(name: str, pattern: str) -> bool:
    # The kernel keeps 15 characters of a process name (comm): "nvidia-persistenced"
    # shows as "nvidia-persiste", so a 15-character name also matches a pattern's head.
    if fnmatch.fnmatchcase(name, pattern):
        return True
    return len(name) == COMM_LEN and fnmatch.fnmatchcase(name, pattern[:COMM_LEN])


def plan_reap(holders: Iterable[GpuProcess], table: ProcessTable, cfg: ReapConfig, self_pid: int) -> ReapPlan:
    """Decide, without side effects, which GPU holders (and their companions) would be killed."""
    rules = KillRules(cfg)
    untouchable = ancestors(table, self_pid)
    by_pid: dict[int, list[GpuProcess]] = {}
    for h in holders:
        by_pid.setdefault(h.pid, []).append(h)

    victims: dict[int, Victim] = {}
    spared: list[Spared] = []
    for pid, entries in sorted(by_pid.items()):
        gpus = tuple(sorted({e.gpu for e in entries}))
        known = [e.used_mib for e in entries if e.used_mib is not None]
        used = sum(known) if known else None
        proc = table.get(pid)
        reason = None
        if proc is None and os.path.exists(f"/proc/{pid}"):
            reason = "is exiting; the driver is still releasing its memory"
        elif proc is None:
            reason = (
                "NVML reports this PID but no such process is visible in this PID namespace "
                "(NVML gives host PIDs; is the supervisor in a container?)"
            )
        elif pid in untouchable:
            reason = "is the supervisor itself, one of its ancestors, or PID 1"
        elif rules.protected(proc):
            reason = f"protected name {proc.name!r}"
        elif not cfg.enabled:
            reason = "reaping is disabled (preflight.reap.enabled = false)"
        elif not rules.matches(proc):
            reason = "does not match preflight.reap.names / preflight.reap.cmdline"
        if reason is None and proc is not None:
            by_gpu = tuple((e.gpu, e.used_mib) for e in entries if e.used_mib is not None)
            victims[pid] = Victim(proc, gpus, used, "holds a CUDA context", by_gpu)
        else:
            spared.append(Spared(pid, gpus, used, proc, reason or ""))

    if victims:
        _add_tree_members(victims, table, rules, untouchable)
    return ReapPlan(tuple(victims.values()), tuple(spared))


def _add_tree_members(victims: dict[int, Victim], table: ProcessTable, rules: KillRules, untouchable: set[int]) -> None:
    holders = list(victims.values())
    # Ancestors of a holder that match the kill rules are the stale tree's root
    # (the API server); killing only the workers would leave it half-alive.
    for v in holders:
        parent = table.get(v.proc.ppid)
        while parent is not None and parent.pid not in untouchable and parent.pid not in victims:
            if rules.protected(parent) or not rules.matches(parent):
                break
            victims[parent.pid] = Victim(parent, (), None, f"parent of PID {v.proc.pid}")
            parent = table.get(parent.ppid)
    pids = set(victims)
    # Our own session (and our ancestors') is never a stale tree's session.
    ours = {p.sid for p in (table.get(pid) for pid in untouchable) if p is not None}
    sessions = {v.proc.sid for v in victims.values()} - ours - {-1, 0}
    for proc in table.all():
        if proc.pid in victims or proc.pid in untouchable or rules.protected(proc) or not rules.companion(proc):
            continue
        if proc.ppid in pids or proc.sid in sessions:
            owner = proc.ppid if proc.ppid in pids else next(p for p, v in victims.items() if v.proc.sid == proc.sid)
            victims[proc.pid] = Victim(proc, (), None, f"companion of PID {owner}")


def execute_reap(
    plan: ReapPlan,
    table: ProcessTable,
    clock: Clock,
    grace_s: float,
    on_signal: Callable[[Victim, signal.Signals], None],
    kill_wait_s: float = 5.0,
    poll_s: float = 0.05,
) -> ReapOutcome:
    """SIGTERM every victim, poll until `grace_s`, SIGKILL the rest, poll again."""
    start = clock.monotonic()
    pending = [v for v in plan.victims if table.alive(v.proc)]
    for v in pending:
        if table.signal(v.proc, signal.SIGTERM):
            on_signal(v, signal.SIGTERM)
    pending = _wait_dead(pending, table, clock, start + grace_s, poll_s)
    terminated = tuple(v.proc for v in plan.victims if v not in pending)
    for v in pending:
        if table.signal(v.proc, signal.SIGKILL):
            on_signal(v, signal.SIGKILL)
    survivors = _wait_dead(pending, table, clock, clock.monotonic() + kill_wait_s, poll_s)
    killed = tuple(v.proc for v in pending if v not in survivors)
    return ReapOutcome(terminated, killed, tuple(v.proc for v in survivors), clock.monotonic() - start)


def _wait_dead(
    pending: list[Victim], table: ProcessTable, clock: Clock, deadline: float, poll_s: float
) -> list[Victim]:
    while pending:
        pending = [v for v in pending if table.alive(v.proc)]
        if not pending or clock.monotonic() >= deadline:
            break
        clock.sleep(poll_s)
    return pending
