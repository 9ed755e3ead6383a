"""Reaping stale GPU processes: decide who may die, then TERM, poll, KILL.

"Stale" means orphaned from its supervisor, nothing else.  Only a process
that holds a CUDA context on a configured GPU (NVML lists it), matches the
kill rules and is owned by one of `preflight.reap.users` is a victim.  Merely
having /dev/nvidia* open (nvidia-persistenced, DCGM, monitoring agents, this
supervisor after nvmlInit) never makes a process a candidate.  PID 1, the
supervisor and its ancestors, protected names, and every process of a live
kimi-supervisor's tree (a descendant of one, or a process in the cgroup of a
kimi-supervisor unit whose supervisor lives) are never signalled.  A victim's
stale tree may take along its companions (the multiprocessing
resource_tracker) and ancestors that pass the same tests.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import pwd
import re
import signal
from collections.abc import Callable, Iterable

from kimi_supervisor.clock import Clock
from kimi_supervisor.config.model import ReapConfig
from kimi_supervisor.host.gpu import GpuProcess
from kimi_supervisor.host.instance_lock import SUPERVISOR_ARGV
from kimi_supervisor.host.proctable import ProcessTable, ProcInfo, ancestors

COMM_LEN = 15
MAX_DEPTH = 64  # ancestry walks stop here (a cycle in a racing /proc read must not hang us)
# A multiprocessing child (spawn or forkserver) before or without setproctitle: it belongs to
# the vLLM tree it descends from, and matches only through that tree.
MP_CHILD = re.compile(r"multiprocessing\.(spawn|forkserver)|--multiprocessing-fork")
_SUPERVISOR_UNIT = re.compile(r"/kimi-supervisor[^/]*\.service(/|$)")


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

    def matches_in_tree(self, proc: ProcInfo, table: ProcessTable) -> bool:
        """The rules, or a multiprocessing child whose ancestor or session leader matches them."""
        if self.matches(proc):
            return True
        if not MP_CHILD.search(_command(proc)):
            return False
        leader = table.get(proc.sid) if proc.sid > 1 else None
        if leader is not None and leader.pid != proc.pid and self.matches(leader):
            return True
        return any(self.matches(a) for a in _ancestry(proc, table))

    def companion(self, proc: ProcInfo) -> bool:
        command = _command(proc)
        return any(rx.search(command) for rx in self._cfg.companions)


def _ancestry(proc: ProcInfo, table: ProcessTable) -> list[ProcInfo]:
    found: list[ProcInfo] = []
    current = table.get(proc.ppid) if proc.ppid > 1 else None
    while current is not None and len(found) < MAX_DEPTH and current.pid not in {p.pid for p in found}:
        found.append(current)
        current = table.get(current.ppid) if current.ppid > 1 else None
    return found


def allowed_uids(users: Iterable[str]) -> dict[int, str]:
    """preflight.reap.users as uid -> name; a name this host does not know owns nothing."""
    uids: dict[int, str] = {}
    for user in users:
        try:
            entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
            uids[entry.pw_uid] = entry.pw_name
        except (KeyError, ValueError):
            if user.isdigit():
                uids[int(user)] = user
    return uids


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class LiveTrees:
    """The process trees of live kimi-supervisors other than us: never stale, never reaped.

    A live supervisor is a root process holding an instance lock (`lock_owners`, from the
    kernel's lock table, already only root kimi-supervisors) or one whose command line is
    kimi-supervisor's: root's only, since any user can run a process with that argv (or flock
    a lock file it can read) to shield its own GPU occupants.  Its tree is every
    descendant, and, when it runs as a kimi-supervisor unit, every process in that
    unit's cgroup (workers that double-forked away from it stay there).
    """

    def __init__(self, table: ProcessTable, self_pid: int, lock_owners: Iterable[int]) -> None:
        self._table = table
        pids = set(lock_owners)
        pids |= {p.pid for p in table.all() if p.uid == 0 and SUPERVISOR_ARGV.search(_command(p))}
        found = {pid: table.get(pid) for pid in pids - {self_pid, 0, 1}}
        self.supervisors = {pid for pid, p in found.items() if p is not None and p.uid == 0}
        self._units: dict[str, int] = {}
        for pid in sorted(self.supervisors):
            cgroup = table.cgroup(pid)
            if cgroup and _SUPERVISOR_UNIT.search(cgroup):
                self._units.setdefault(_unit_root(cgroup), pid)

    def owner(self, proc: ProcInfo) -> str | None:
        """Why `proc` belongs to a live supervisor's tree, or None."""
        if not self.supervisors:
            return None
        for a in _ancestry(proc, self._table):
            if a.pid in self.supervisors:
                return f"descends from a live kimi-supervisor (PID {a.pid})"
        if self._units:
            cgroup = self._table.cgroup(proc.pid) or ""
            for unit, pid in self._units.items():
                if cgroup == unit or cgroup.startswith(unit + "/"):
                    return f"runs in {unit.rsplit('/', 1)[-1]}, the cgroup of a live kimi-supervisor (PID {pid})"
        return None


def _unit_root(cgroup: str) -> str:
    match = _SUPERVISOR_UNIT.search(cgroup)
    assert match is not None
    return cgroup[: match.end()].rstrip("/")


def _command(proc: ProcInfo) -> str:
    return " ".join(proc.cmdline).replace("\n", " ")


def _name_matches(name: str, pattern: str) -> bool:
    # The kernel keeps 15 characters of a process name (comm): "nvidia-persistenced"
    # shows as "nvidia-persiste", so a 15-character name also matches a pattern's head.
    if fnmatch.fnmatchcase(name, pattern):
        return True
    return len(name) == COMM_LEN and fnmatch.fnmatchcase(name, pattern[:COMM_LEN])


class _Judge:
    """Why a process may not be killed (None: it may), shared by occupants, parents and companions."""

    def __init__(self, table: ProcessTable, cfg: ReapConfig, self_pid: int, lock_owners: Iterable[int]) -> None:
        self.rules = KillRules(cfg)
        self.table = table
        self.untouchable = ancestors(table, self_pid)
        self.live = LiveTrees(table, self_pid, lock_owners)
        self.uids = allowed_uids(cfg.users)
        self.users = cfg.users

    def guard(self, proc: ProcInfo) -> str | None:
        """The checks every victim passes, whatever made it a candidate."""
        if proc.pid in self.untouchable:
            return "is the supervisor itself, one of its ancestors, or PID 1"
        if self.rules.protected(proc):
            return f"protected name {proc.name!r}"
        live = self.live.owner(proc)
        if live is not None:
            return live
        if proc.uid not in self.uids:
            return f"owned by user {user_name(proc.uid)}, not one of preflight.reap.users {list(self.users)}"
        return None


def plan_reap(
    occupants: Iterable[GpuProcess],
    table: ProcessTable,
    cfg: ReapConfig,
    self_pid: int,
    lock_owners: Iterable[int] = (),
) -> ReapPlan:
    """Decide, without side effects, which GPU occupants (and their companions) would be killed.

    `lock_owners`: PIDs holding kimi-supervisor instance locks (live supervisors).
    """
    by_pid: dict[int, list[GpuProcess]] = {}
    for h in occupants:
        by_pid.setdefault(h.pid, []).append(h)
    if not by_pid:
        return ReapPlan((), ())
    judge = _Judge(table, cfg, self_pid, lock_owners)

    victims: dict[int, Victim] = {}
    spared: list[Spared] = []
    for pid, entries in sorted(by_pid.items()):
        gpus, used, by_gpu = _held(entries)
        proc = table.get(pid)
        reason = None
        if proc is None and os.path.exists(f"/proc/{pid}"):
            reason = "is exiting; the driver is still releasing its memory"
        elif proc is None:
            reason = (
                "NVML reports this PID but no such process is visible in this PID namespace "
                "(NVML gives host PIDs; is the supervisor in a container?)"
            )
        else:
            reason = judge.guard(proc)
            if reason is None and not cfg.enabled:
                reason = "reaping is disabled (preflight.reap.enabled = false)"
            elif reason is None and not judge.rules.matches_in_tree(proc, table):
                reason = "does not match preflight.reap.names / preflight.reap.cmdline"
        if reason is None and proc is not None:
            victims[pid] = Victim(proc, gpus, used, "holds a CUDA context", by_gpu)
        else:
            spared.append(Spared(pid, gpus, used, proc, reason or ""))

    if victims:
        _add_tree_members(victims, judge, by_pid)
    # A tree member that NVML lists too (a resource tracker that holds memory) is a victim, not spared.
    return ReapPlan(tuple(victims.values()), tuple(s for s in spared if s.pid not in victims))


def _held(entries: list[GpuProcess]) -> tuple[tuple[int, ...], int | None, tuple[tuple[int, int], ...]]:
    """What NVML says one PID holds: its GPUs, the MiB summed (None when NVML would not say) and per GPU."""
    known = [(e.gpu, e.used_mib) for e in entries if e.used_mib is not None]
    return tuple(sorted({e.gpu for e in entries})), sum(m for _, m in known) if known else None, tuple(known)


def _member(proc: ProcInfo, why: str, by_pid: dict[int, list[GpuProcess]]) -> Victim:
    """A parent or companion of an occupant, with what NVML says it holds itself: the memory its kill frees is
    counted by a dry run as the real run frees it."""
    gpus, used, by_gpu = _held(by_pid.get(proc.pid, []))
    return Victim(proc, gpus, used, why, by_gpu)


def _add_tree_members(victims: dict[int, Victim], judge: _Judge, by_pid: dict[int, list[GpuProcess]]) -> None:
    table, rules = judge.table, judge.rules
    occupants = list(victims.values())
    # Ancestors of an occupant that match the kill rules are the stale tree's root
    # (the API server); killing only the workers would leave it half-alive.
    # The rules are anchored at argv[0]: a wrapper (runuser, sudo, tmux, bash -c)
    # whose arguments spell a vLLM command line does not match, and the walk stops there.
    for v in occupants:
        parent = table.get(v.proc.ppid)
        while parent is not None and parent.pid not in victims:
            if judge.guard(parent) is not None or not rules.matches(parent):
                break
            victims[parent.pid] = _member(parent, f"parent of PID {v.proc.pid}", by_pid)
            parent = table.get(parent.ppid)
    pids = set(victims)
    # Our own session (and our ancestors') is never a stale tree's session.
    ours = {p.sid for p in (table.get(pid) for pid in judge.untouchable) if p is not None}
    sessions = {v.proc.sid for v in victims.values()} - ours - {-1, 0}
    for proc in table.all():
        if proc.pid in victims or not rules.companion(proc) or judge.guard(proc) is not None:
            continue
        if proc.ppid in pids or proc.sid in sessions:
            owner = proc.ppid if proc.ppid in pids else next(p for p, v in victims.items() if v.proc.sid == proc.sid)
            victims[proc.pid] = _member(proc, f"companion of PID {owner}", by_pid)


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
