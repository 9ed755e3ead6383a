"""Preflight: make the host ready for `vllm serve`, or say exactly why not.

Order matters and is chosen so nothing is killed for a start that cannot
happen anyway:
  1. static checks (NVML, GPU count vs --tensor-parallel-size, model files);
  2. stale GPU occupants: plan, then (real run) TERM/KILL them and wait for memory;
  3. stale shared-memory files (after the reap released them);
  4. the serving port and the --gpu-memory-utilization fraction.
A dry run takes the same path with every side effect replaced by a report line.
Nothing here exits; a real run raises PreflightError.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable
from typing import Any

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.cachedirs import check_cache
from kimi_supervisor.child.process import child_environment
from kimi_supervisor.child.spawnplan import Unresolvable, resolve_identity
from kimi_supervisor.clock import Clock
from kimi_supervisor.config import role_spec, timeouts
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import GpuNeedsReset, PreflightError
from kimi_supervisor.host import weightcache
from kimi_supervisor.host.gpu import (
    MIB,
    GpuMemory,
    GpuProbe,
    GpuProcess,
    GpuUnavailable,
    busy_gpus,
    gpu_processes,
    wait_until_free,
)
from kimi_supervisor.host.instance_lock import lock_owners, supervisor_of, weights_supervisor
from kimi_supervisor.host.procstate import needs_reset
from kimi_supervisor.host.proctable import ProcessTable, ProcInfo, ancestors
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.preflight import checks, gpu_health, memory_plan
from kimi_supervisor.preflight.reaper import ReapPlan, Victim, execute_reap, plan_reap
from kimi_supervisor.preflight.shm import plan_shm, remove_stale
from kimi_supervisor.roles import Role


@dataclasses.dataclass
class PreflightReport:
    dry_run: bool
    checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def proceed(self) -> bool:
        return not any(c.blocking for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.blocking]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "verdict": "start would proceed" if self.proceed else "start would not proceed",
            "proceed": self.proceed,
            "checks": [
                {"name": c.name, "status": c.verdict.value, "message": c.message, **dict(c.data)} for c in self.checks
            ],
        }


def _mib(value: int | None) -> str:
    return f"{value} MiB" if value is not None else "unknown MiB"


def describe_victim(v: Victim) -> str:
    gpus = f" on GPU {','.join(map(str, v.gpus))}" if v.gpus else ""
    return f"PID {v.proc.pid} ({v.proc.name}){gpus}, {_mib(v.used_mib) if v.gpus else v.why}: {v.proc.command[:200]}"


def holder_memory(cfg: Config, table: ProcessTable, found: list[GpuProcess]) -> tuple[int | None, dict[int, int]]:
    """What the deployment's live weight holder holds on each GPU: the processes of its supervisor's tree (the
    root kimi-supervisor holding `deployment-NAME.weights.lock`), the engine's own memory (docs/kill-safety.md).
    (its supervisor's PID or None, MiB per GPU, per NVML)."""
    supervisor = weights_supervisor(cfg.paths.runtime_directory, cfg.deployment.name)
    if supervisor is None:
        return None, {}
    held: dict[int, int] = {}
    for p in found:
        if p.used_mib is not None and supervisor in ancestors(table, p.pid) - {p.pid, 0, 1}:
            held[p.gpu] = held.get(p.gpu, 0) + p.used_mib
    return supervisor, held


def partner_memory(
    cfg: Config, table: ProcessTable, found: list[GpuProcess], but: tuple[str, ...] = ()
) -> dict[int, dict[int, int]]:
    """What the deployment's other live supervisors whose memory is this one's own (config/role_spec.py
    memory_partners: the engine's, the spare's, besides the holder) hold on each GPU: their supervisor's PID ->
    MiB per GPU, per NVML.  A partner whose supervisor is gone is not there: its tree is stale like any other.
    `but`: the partners (by role file suffix) left out."""
    out: dict[int, dict[int, int]] = {}
    for suffix in (s for s in role_spec.of(cfg.role).memory_partners if s not in but):
        supervisor = supervisor_of(cfg.paths.runtime_directory, cfg.deployment.name, suffix)
        if supervisor is None or supervisor == os.getpid():
            continue
        held: dict[int, int] = {}
        for p in found:
            if p.used_mib is not None and supervisor in ancestors(table, p.pid) - {p.pid, 0, 1}:
                held[p.gpu] = held.get(p.gpu, 0) + p.used_mib
        out[supervisor] = held
    return out


def own_memory(cfg: Config, table: ProcessTable, found: list[GpuProcess], but: tuple[str, ...] = ()) -> dict[int, int]:
    """MiB per GPU of the deployment's own that no process of this supervisor's tree holds: its partners' (the
    holder's, the engine's or the spare's, as its role says, `but` those), summed over them."""
    total: dict[int, int] = {}
    for held in partner_memory(cfg, table, found, but).values():
        for gpu, mib in held.items():
            total[gpu] = total.get(gpu, 0) + mib
    return total


def credited_memory(
    table: ProcessTable, found: list[GpuProcess], supervisor: int, daemons: dict[int, int]
) -> dict[int, int]:
    """MiB per GPU that vLLM will subtract from its budget: what each of the holder's daemons answered to
    get_memory (`daemons`, PID -> bytes; host/weightcache.py), at most what NVML shows for that process there,
    rounded down.  A daemon that did not answer is credited nothing, as vLLM's start would then fail anyway."""
    left = {pid: nbytes // MIB for pid, nbytes in daemons.items()}
    credit: dict[int, int] = {}
    for p in sorted(found, key=lambda p: (p.gpu, p.pid)):
        if p.pid in left and p.used_mib is not None and supervisor in ancestors(table, p.pid) - {p.pid, 0, 1}:
            mib = min(p.used_mib, left[p.pid])
            left[p.pid] -= mib
            credit[p.gpu] = credit.get(p.gpu, 0) + mib
    return credit


class Preflight:
    def __init__(
        self, cfg: Config, probe: GpuProbe, table: ProcessTable, clock: Clock, log: Logger, self_pid: int | None = None
    ) -> None:
        self._cfg = cfg
        self._pf = cfg.preflight
        self._probe = probe
        self._table = table
        self._clock = clock
        self._log = log
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._held: dict[int, int] = {}  # MiB per GPU the deployment's weight holder holds (the engine's own)
        self._credit: dict[int, int] = {}  # of it, what vLLM subtracts from its budget (credited_memory)
        self._held_by_holder: dict[int, int] = {}  # of it, the holder's alone (a spare's memory plan counts it)
        self._daemons = weightcache.allocated  # the daemons' own answer to get_memory

    def run(self, *, dry_run: bool) -> PreflightReport:
        report = PreflightReport(dry_run)
        add = report.checks.append
        gpus = self._static_checks(add)
        add(timeouts.check_grace(self._cfg))
        if self._cfg.child.vllm.config_file is not None:
            add(checks.vllm_config(self._cfg.child.vllm))
        if self._pf.check_model:
            add(checks.check_model(self._cfg.child.vllm.model))
        if dry_run:  # a report for the operator; a real start sets the caches up at the spawn (cachedirs.py)
            add(self._cache())
        if gpus:  # before anything is killed: a sick GPU fails the start either way
            report.checks += gpu_health.health_checks(self._probe, gpus, self._cfg.gpu_health, self._log)
        if not dry_run:
            self._raise_if_failed(report)
        plan = ReapPlan((), ())
        if gpus:
            plan = self._gpus(gpus, dry_run, add)
            if not dry_run:
                self._raise_if_failed(report)
        if self._pf.shm.enabled:
            self._shm(dry_run, add)
        # Whether the child listens on a port is its role's (config/role_spec.py): a follower (--headless) opens
        # none.  The holder's /health port is checked as an API port: taken, vLLM's health thread dies while its
        # READY line still comes, and a squatter answering 200 would pass for the holder (preload.py:81-100 runs
        # uvicorn in a daemon thread and never looks back).
        # vLLM on its --uds socket binds no TCP port: the public one is its front's (docs/front.md).
        if self._pf.check_port and role_spec.of(self._cfg.role).opens_port and self._cfg.child.vllm.uds is None:
            add(self._port(plan, dry_run))
        if gpus:
            # A dry run killed nothing: count what the victims hold as free, as a real start would see it.
            releasable: dict[int, int] = {}
            for gpu, mib in (pair for v in plan.victims for pair in v.mib_by_gpu) if dry_run else ():
                releasable[gpu] = releasable.get(gpu, 0) + mib
            # The holder's weights are the engine's own: it maps them instead of allocating, and vLLM subtracts
            # what the daemons' PyTorch allocators hold from its budget (v1/worker/utils.py:716-768), no more: the
            # rest of what NVML shows for them (CUDA context, NCCL, cached blocks) stays used.
            for gpu, mib in self._credit.items():
                releasable[gpu] = releasable.get(gpu, 0) + mib
            memory = [self._probe.memory(i) for i in gpus]
            add(checks.check_free_memory(memory, self._cfg.child.vllm.gpu_memory_utilization, releasable))
            if self._cfg.spare is not None:  # a hot spare beside the engine on these GPUs (docs/spare.md)
                add(self._memory_plan(memory))
        if not dry_run:
            self._raise_if_failed(report)
        return report

    def _memory_plan(self, memory: list[GpuMemory]) -> Check:
        """The weights, the engine and the spare on each GPU (preflight/memory_plan.py): the holder's memory as NVML
        shows it when it is live, else the checkpoint's share of each GPU from its files."""
        spare = self._cfg.spare
        assert spare is not None
        held = {g: m for g, m in self._held_by_holder.items() if m > 0}
        if held:
            return memory_plan.plan(memory, held, "the live holder, NVML", spare)
        vllm = self._cfg.child.vllm
        estimate = memory_plan.checkpoint_mib_per_gpu(vllm.model, vllm.world_size)
        if estimate is None:
            return Check(
                "memory_plan",
                Verdict.WARN,
                f"no live weight holder and no checkpoint's safetensors at {vllm.model}: the weights' share of each "
                "GPU is unknown, so whether the engine and the spare fit beside them is not checked",
            )
        return memory_plan.plan(
            memory, dict.fromkeys((m.index for m in memory), estimate), "the checkpoint's files / GPUs", spare
        )

    def _cache(self) -> Check:
        """Where the child's compile caches go, their size, and whether the child's user can write them."""
        spec = self._cfg.child
        try:
            identity = resolve_identity(spec.user, spec.group)
        except Unresolvable as exc:
            return Check("cache", Verdict.SKIP, f"child.{exc.key}: {exc.message}")
        return check_cache(spec.cache_directory, identity, child_environment(spec, os.environ, identity))

    def _raise_if_failed(self, report: PreflightReport) -> None:
        failed = report.failures()
        if failed:
            raise PreflightError(
                "preflight failed: " + "; ".join(f"{c.name}: {c.message}" for c in failed),
                detail=[f"{c.name}: {c.message}" for c in failed[1:]],
            )

    def _static_checks(self, add: Callable[[Check], None]) -> tuple[int, ...]:
        if self._pf.gpus == ():
            add(Check("gpus", Verdict.SKIP, "preflight.gpus = []: no GPU checks (CPU deployment)"))
            return ()
        try:
            visible = self._probe.device_count()
        except GpuUnavailable as exc:
            add(Check("nvml", Verdict.FAIL, str(exc)))
            return ()
        selected = self._pf.gpus if self._pf.gpus is not None else tuple(range(visible))
        cluster = self._cfg.cluster
        if cluster is not None:  # a group node holds its share of the world (deployment/group/checks.py)
            check = checks.check_local_gpus(visible, selected, cluster.local_world_size, cluster.nnodes)
        else:
            vllm = self._cfg.child.vllm
            check = checks.check_gpu_count(
                visible, selected, vllm.tensor_parallel_size, vllm.world_size, vllm.parallel_flags
            )
        add(check)
        return selected if check.verdict is Verdict.OK else ()

    # -- GPU occupants -------------------------------------------------------

    def _gpus(self, gpus: tuple[int, ...], dry_run: bool, add: Callable[[Check], None]) -> ReapPlan:
        try:
            found = gpu_processes(self._probe, gpus)
            self._held = self._holder_memory(found, add)
            busy = busy_gpus(self._probe, gpus, self._pf.memory_threshold_mib, self._held)
        except GpuUnavailable as exc:
            add(Check("nvml", Verdict.FAIL, str(exc)))
            return ReapPlan((), ())
        plan = self._plan(found)
        if dry_run:
            for v in plan.victims:
                add(Check("reap", Verdict.KILL, describe_victim(v), {"pid": v.proc.pid, "gpus": list(v.gpus)}))
            self._dry_wait(busy, found, plan, add)
            return plan
        if plan.victims:
            self._reap(plan, add)
        self._wait(gpus, add)
        return plan

    def _holder_memory(self, found: list[GpuProcess], add: Callable[[Check], None]) -> dict[int, int]:
        # role branch: the preflight runs with a config alone (a dry run, gpuaccept): an engine mapping its holder's
        # weights credits them (deployment/engine.py's own_memory asks the same holder_memory for the stop)
        if not self._cfg.maps_held_weights:
            return {}
        name = self._cfg.deployment.name
        supervisor, held = holder_memory(self._cfg, self._table, found)
        if supervisor is None:
            add(Check("weights_memory", Verdict.SKIP, f"no live weight holder of deployment {name}: nothing to count"))
            return {}
        # The engine's and the spare's trees beside it (docs/spare.md): each other's own, never busy; the
        # holder's is counted below with what vLLM credits of it.
        partners = own_memory(self._cfg, self._table, found, but=(Role.WEIGHTS.file_suffix,))
        if partners:
            text = ", ".join(f"GPU {g}: {mib} MiB" for g, mib in sorted(partners.items()))
            add(
                Check(
                    "partner_memory",
                    Verdict.OK,
                    f"deployment {name}'s other engine (the engine or its spare) holds {text}: counted as this "
                    "deployment's own (not busy, never reaped)",
                    {"mib_by_gpu": {str(g): m for g, m in sorted(partners.items())}},
                )
            )
        assert self._cfg.weights is not None
        self._held_by_holder = held
        daemons, unanswered = self._daemons(self._cfg.weights.socket_dir)
        self._credit = credited_memory(self._table, found, supervisor, daemons)
        text = ", ".join(f"GPU {g}: {mib} MiB" for g, mib in sorted(held.items())) or "nothing on these GPUs"
        credit = ", ".join(f"GPU {g}: {mib} MiB" for g, mib in sorted(self._credit.items())) or "nothing"
        silent = f" (no answer: {'; '.join(unanswered)})" if unanswered else ""
        add(
            Check(
                "weights_memory",
                Verdict.OK,
                f"the weight holder of deployment {name} (supervisor PID {supervisor}) holds {text}: "
                "counted as this deployment's own (not busy); of it, its daemons' PyTorch allocations, "
                f"{credit}{silent}, are free for --gpu-memory-utilization (vLLM subtracts only those)",
                {
                    "supervisor_pid": supervisor,
                    "mib_by_gpu": {str(g): m for g, m in sorted(held.items())},
                    "credited_mib_by_gpu": {str(g): m for g, m in sorted(self._credit.items())},
                },
            )
        )
        return {g: held.get(g, 0) + partners.get(g, 0) for g in set(held) | set(partners)}

    def _plan(self, found: list[GpuProcess]) -> ReapPlan:
        # Every supervisor holding an instance lock is live: its tree is never stale.
        owners = lock_owners(self._cfg.paths.runtime_directory)
        return plan_reap(found, self._table, self._pf.reap, self._self_pid, owners)

    def _dry_wait(
        self, busy: list[GpuMemory], found: list[GpuProcess], plan: ReapPlan, add: Callable[[Check], None]
    ) -> None:
        # Predict what the real run's wait sees once the victims are gone: a GPU passes when what
        # stays is at or below the threshold, whoever holds it (a small agent outside the rules too).
        threshold = self._pf.memory_threshold_mib
        victim_pids = {v.proc.pid for v in plan.victims}
        still: list[str] = []
        for m in busy:
            others = [p for p in found if p.gpu == m.index and p.pid not in victim_pids]
            reaped = [p for p in found if p.gpu == m.index and p.pid in victim_pids]
            left = m.used_mib - sum(p.used_mib or 0 for p in reaped)
            if any(p.used_mib is None for p in reaped):
                # NVML would not say what a victim holds: assume all of it returns, all but the others' share.
                left = min(left, sum(p.used_mib or 0 for p in others))
            if left <= threshold:
                continue
            still.append(
                f"GPU {m.index}: {m.used_mib} MiB used > {threshold} MiB by {self._occupants_text(others, plan)}"
            )
        if still:
            add(
                Check(
                    "gpu_wait",
                    Verdict.WAIT,
                    f"a start would wait up to {self._pf.deadline_s:g}s, then fail: " + "; ".join(still),
                )
            )
        elif busy:
            add(Check("gpu_wait", Verdict.OK, f"{len(busy)} busy GPU(s) would be freed by reaping"))
        else:
            add(Check("gpu_wait", Verdict.OK, f"all GPUs at or below {threshold} MiB used"))

    def _occupants_text(self, procs: list[GpuProcess], plan: ReapPlan) -> str:
        spared = {s.pid: s for s in plan.spared}
        if not procs:
            return "no process NVML lists (another PID namespace or driver-internal use)"
        parts = []
        for p in procs:
            s = spared.get(p.pid)
            name = f" ({s.proc.name})" if s and s.proc else ""
            why = f": not killed, {s.reason}" if s else ""
            parts.append(f"PID {p.pid}{name} {_mib(p.used_mib)}{why}")
        return ", ".join(parts)

    def _reap(self, plan: ReapPlan, add: Callable[[Check], None]) -> None:
        def on_signal(v: Victim, sig: signal.Signals) -> None:
            self._log.warning(
                "preflight.kill",
                pid=v.proc.pid,
                name=v.proc.name,
                signal=sig.name,
                gpu=",".join(map(str, v.gpus)),
                used_mib=v.used_mib,
                why=v.why,
                cmdline=v.proc.command[:500],
            )

        grace, kill_wait = self._pf.reap.grace_s, timeouts.SIGKILL_WAIT_S
        outcome = execute_reap(plan, self._table, self._clock, grace, on_signal, kill_wait)
        self._log.info(
            "preflight.reaped",
            terminated=len(outcome.terminated),
            killed=len(outcome.killed),
            survivors=len(outcome.survivors),
            seconds=round(outcome.seconds, 3),
        )
        for v in plan.victims:
            verdict = Verdict.FAIL if v.proc in outcome.survivors else Verdict.DONE
            verb = "survived SIGKILL" if verdict is Verdict.FAIL else "killed"
            add(Check("reap", verdict, f"{verb} {describe_victim(v)}", {"pid": v.proc.pid, "gpus": list(v.gpus)}))
        self._raise_if_stuck(plan, outcome.survivors)

    def _raise_if_stuck(self, plan: ReapPlan, survivors: tuple[ProcInfo, ...]) -> None:
        """A victim that outlived SIGKILL in D state on our GPUs is stuck in the kernel: its GPUs free only with a
        GPU reset or a reboot, so say so now (the exit the unit does not restart on) instead of waiting
        preflight.deadline_s out.  On our GPUs: NVML lists it, or it waits in the NVIDIA driver; a stale tree's
        companion or parent in D state elsewhere (a hung network mount) may still go.  A survivor in another state
        (another PID namespace, a signal refused) keeps the wait too."""
        listed = {v.proc.pid for v in plan.victims if v.gpus}
        states = [(p, self._table.state(p.pid)) for p in survivors]
        # Alive asked after the state was read: a survivor that went since and left its PID to a newcomer in D
        # state (a container's small PID namespace) is not stuck, and exit 22 is not restarted on.
        stuck = [
            s
            for p, s in states
            if s is not None and s.uninterruptible and (s.pid in listed or s.in_nvidia_driver) and self._table.alive(p)
        ]
        if not stuck:
            return
        pids = {s.pid for s in stuck}
        gpus = tuple(sorted({g for v in plan.victims if v.proc.pid in pids for g in v.gpus}))
        for s in stuck:
            self._log.error("preflight.unkillable", pid=s.pid, name=s.name, state=s.state, wchan=s.wchan)
        what = f"{len(stuck)} stale process(es) on them outlived SIGKILL by {timeouts.SIGKILL_WAIT_S:g}s"
        raise GpuNeedsReset(f"preflight: {needs_reset(gpus, stuck, what)}"[:1000])

    def _wait(self, gpus: tuple[int, ...], add: Callable[[Check], None]) -> None:
        start = self._clock.monotonic()

        def still_busy(busy: list[GpuMemory], elapsed: float) -> None:
            for m in busy:
                self._log.warning(
                    "preflight.gpu_busy",
                    gpu=m.index,
                    used_mib=m.used_mib,
                    waited_s=round(elapsed, 1),
                    occupants=self._occupants_text(self._probe.processes(m.index), ReapPlan((), ())),
                )

        try:
            busy = wait_until_free(
                self._probe,
                gpus,
                self._pf.memory_threshold_mib,
                self._clock,
                self._pf.deadline_s,
                self._pf.poll_interval_s,
                still_busy,
                self._pf.busy_log_interval_s,
                self._held,
            )
        except GpuUnavailable as exc:
            add(Check("nvml", Verdict.FAIL, str(exc)))
            return
        waited = self._clock.monotonic() - start
        if busy:
            # Recompute the plan: it tells, per occupant, why it was not killed.
            found = gpu_processes(self._probe, tuple(m.index for m in busy))
            plan = self._plan(found)
            text = "; ".join(
                f"GPU {m.index}: {m.used_mib} MiB used by "
                f"{self._occupants_text([p for p in found if p.gpu == m.index], plan)}"
                for m in busy
            )
            add(
                Check(
                    "gpu_wait",
                    Verdict.FAIL,
                    f"GPUs still busy after {waited:.1f}s (preflight.deadline_s = {self._pf.deadline_s:g}): {text}",
                )
            )
        else:
            add(
                Check(
                    "gpu_wait",
                    Verdict.OK,
                    f"all {len(gpus)} GPU(s) at or below "
                    f"{self._pf.memory_threshold_mib} MiB used (waited {waited:.2f}s)",
                )
            )

    # -- shared memory and port ----------------------------------------------

    def _shm(self, dry_run: bool, add: Callable[[Check], None]) -> None:
        directory = self._pf.shm.directory
        if directory.is_dir() and not os.access(directory, os.W_OK):
            # NCCL and torch multiprocessing create their segments here: TP cannot start without it.
            add(
                Check(
                    "shm",
                    Verdict.FAIL,
                    f"{directory} is not writable (read-only or no permission): "
                    "NCCL and torch need it for their shared-memory segments",
                )
            )
            return
        try:
            decisions = plan_shm(self._pf.shm, self._table)
        except OSError as exc:
            add(Check("shm", Verdict.FAIL, str(exc)))
            return
        if not decisions:
            add(
                Check(
                    "shm", Verdict.OK, f"no stale files matching {list(self._pf.shm.globs)} in {self._pf.shm.directory}"
                )
            )
            return
        if dry_run:
            for d in decisions:
                add(
                    Check(
                        "shm",
                        Verdict.REMOVE if d.remove else Verdict.KEEP,
                        f"{d.path}: {d.reason}",
                        {"path": str(d.path)},
                    )
                )
            return
        outcome = remove_stale(decisions)
        for path in outcome.removed:
            self._log.info("preflight.shm_removed", path=str(path))
            add(Check("shm", Verdict.DONE, f"removed {path}", {"path": str(path)}))
        for d in outcome.kept:
            self._log.info("preflight.shm_kept", path=str(d.path), reason=d.reason)
            add(Check("shm", Verdict.KEEP, f"{d.path}: {d.reason}", {"path": str(d.path)}))
        for err in outcome.errors:
            add(Check("shm", Verdict.FAIL, f"cannot remove {err}"))

    def _port(self, plan: ReapPlan, dry_run: bool) -> Check:
        vllm = self._cfg.child.vllm
        check = checks.check_port(vllm.host, vllm.port)
        listener = check.data.get("pid")
        if dry_run and check.verdict is Verdict.FAIL and listener in {v.proc.pid for v in plan.victims}:
            return Check(
                "port",
                Verdict.OK,
                f"port {vllm.port} is held by PID {listener}, which reaping would kill",
                dict(check.data),
            )
        return check
