"""Stopping the tree: SIGTERM, keep reading its output, SIGKILL what outlives the grace; then the GPUs.

`Supervisor._stop` decides why, whether to drain and which grace; this module does the stop itself.  Its
waits are the reactor's turns (reactor.py), so the child's output keeps flowing meanwhile: vLLM's last
lines are often the reason it stopped badly.  A second stop signal (the reactor's `stop_signalled`) cuts
what is left of the grace to `second_signal_grace_s`.

Whatever else ends a run (a bug, KeyboardInterrupt, a broken sink) gets `emergency`: the orderly stop if it
can, SIGKILL and reap without a word if even that raises.  The tree never outlives the supervisor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from collections.abc import Mapping
from typing import Protocol

from kimi_supervisor.child.process import Child
from kimi_supervisor.clock import Clock
from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
from kimi_supervisor.exitcodes import GpuNeedsReset
from kimi_supervisor.host.gpu import GpuMemory, GpuProbe, GpuUnavailable, wait_until_free
from kimi_supervisor.host.procident import ProcIdent, same_start
from kimi_supervisor.host.procstate import ProcState, needs_reset
from kimi_supervisor.host.proctable import ProcessTable
from kimi_supervisor.lifecycle.drain import Drain
from kimi_supervisor.lifecycle.reactor import Reactor
from kimi_supervisor.logs.types import Logger

# While stopping, how often the loop looks at the tree: short, since each look may end the stop.
TERM_POLL_S = 0.05
KILL_POLL_S = 0.02
GPU_POLL_S = 0.1
GPU_REPORT_EVERY_S = 5.0


class Output(Protocol):
    """The child's output (child/output.py's ChildOutput)."""

    def finish(self) -> None: ...  # once the tree is gone: its partial last lines, the sink flushed


@dataclasses.dataclass
class TreeStopper:
    """Stops one spawned tree; `stopped` once it is gone, so an emergency stop knows there is nothing left."""

    child: Child
    reactor: Reactor  # its turns are the stop's waits (output, signals, the child's exit)
    output: Output
    log: Logger
    stopped: bool = dataclasses.field(default=False, init=False)
    # What outlived the last stop's SIGKILL wait: stuck in the kernel, an emergency stop would only wait again.
    survivors: tuple[ProcIdent, ...] = dataclasses.field(default=(), init=False)

    def stop(self, grace_s: float, second_grace_s: float, drain: Drain | None = None) -> bool:
        """True when every member is gone; a drain SIGTERMs vLLM's main alone and reports on the way."""
        child, now, reactor = self.child, self.reactor.monotonic, self.reactor
        start = now()
        deadline = start + grace_s
        signalled = drain.sigterm(child) if drain else child.signal_tree(signal.SIGTERM)
        self.log.info("stop.sigterm", pid=child.pid, processes=signalled, grace_s=grace_s)
        alive = child.alive_members()
        while alive:
            reactor.run_once(TERM_POLL_S)
            if drain:
                drain.tick(child)
            if reactor.stop_signalled("stopping"):
                deadline = min(deadline, now() + second_grace_s)
                self.log.warning("stop.hurry", grace_left_s=round(max(0.0, deadline - now()), 2))
            alive = child.alive_members()
            if alive and now() >= deadline:
                self.log.warning(
                    "stop.sigkill", after_s=round(now() - start, 2), pids=",".join(str(p.pid) for p in alive)
                )
                if drain:
                    drain.sigkill(child)
                child.signal_tree(signal.SIGKILL)
                kill_deadline = now() + SIGKILL_WAIT_S
                while alive and now() < kill_deadline:
                    reactor.run_once(KILL_POLL_S)
                    alive = child.alive_members()
                break
        reactor.run_once(0)
        self.output.finish()
        reactor.unwatch_exit(child)
        child.reap()
        self.stopped = not alive
        # Who they are, not only their PIDs: unkillable() reads /proc after this, and a PID can name a newcomer then.
        self.survivors = tuple(ProcIdent(p.pid, p.create_time()) for p in alive)
        if alive:
            self.log.error("stop.survivors", pids=",".join(str(p.pid) for p in alive))
        self.log.info(
            "stop.tree_gone" if not alive else "stop.tree_left",
            seconds=round(now() - start, 3),
            exit_status=child.poll(),
        )
        if drain:
            drain.finish(tree_gone=not alive)
        return not alive

    def emergency(self, grace_s: float, second_grace_s: float) -> None:
        """The orderly stop; when that raises too (the same broken sink, psutil again): no grace, no output."""
        try:
            self.stop(grace_s, second_grace_s)
        except BaseException:
            with contextlib.suppress(BaseException):
                self.child.signal_tree(signal.SIGKILL)
            with contextlib.suppress(BaseException):
                self.reactor.unwatch_exit(self.child)
            with contextlib.suppress(BaseException):
                self.child.reap()


def unkillable(
    survivors: tuple[ProcIdent, ...],
    table: ProcessTable,
    probe: GpuProbe,
    gpus: tuple[int, ...],
    log: Logger,
    why: str,
) -> GpuNeedsReset | None:
    """The error that ends the run when members outlived SIGKILL_WAIT_S after SIGKILL and the GPU is why; None
    once all are gone, or when nothing says a survivor is the GPU's.

    A process that outlives SIGKILL in the NVIDIA driver (an EngineCore in nvidia_uvm, as vLLM users have seen)
    holds its GPUs until a GPU reset or a reboot, so a restart would only wait out its preflight, fail, and
    restart again.  Its exit code is in the unit's RestartPreventExitStatus= (systemd/unit.py), so it needs
    evidence: NVML lists the survivor on one of our GPUs, or its wait channel or kernel stack is NVIDIA's.  A
    survivor without it (a worker frozen, or waiting on a hung network mount of the model) may still go: the
    run keeps its own, restartable, exit and the next start's preflight waits for it or reaps it, naming it.
    The GPUs named are the ones NVML lists it on; all of ours when NVML lists none (another PID namespace, NVML
    gone) and the driver is its wait.
    """
    stuck = []
    for ident in survivors:
        state = table.state(ident.pid)
        # Asked after the state was read: the same start time then means the state was the survivor's own, not
        # that of a process that got its PID once it finally went (exit 22 is not restarted on).
        now = table.get(ident.pid)
        if state is not None and now is not None and same_start(now.ident, ident):
            stuck.append(state)
    if not stuck:
        return None
    pids = {s.pid for s in stuck}
    try:
        listed = [p for i in gpus for p in probe.processes(i) if p.pid in pids]
    except GpuUnavailable:
        listed = []
    held = tuple(sorted({p.gpu for p in listed}))
    on_gpus = {p.pid for p in listed}
    evidence = {s.pid: _gpu_evidence(s, on_gpus) for s in stuck}
    for s in stuck:
        stack = " < ".join(s.stack or ())
        log.error(
            "stop.unkillable", pid=s.pid, name=s.name, state=s.state, wchan=s.wchan, stack=stack, gpu=evidence[s.pid]
        )
    if not any(evidence.values()):
        log.warning(
            "stop.survivors_not_gpu",
            pids=",".join(str(s.pid) for s in stuck),
            why="NVML lists none on our GPUs and none waits in the NVIDIA driver: not exit 22; the next preflight "
            "waits for or reaps what is left",
        )
        return None
    what = f"{len(stuck)} process(es) of vLLM's tree outlived SIGKILL by {SIGKILL_WAIT_S:g}s"
    return GpuNeedsReset(f"{needs_reset(held or gpus, stuck, what)} (stopping for: {why})"[:1000])


def _gpu_evidence(state: ProcState, on_gpus: set[int]) -> str:
    """Why this survivor is the GPU's business, or "" when nothing says so."""
    if state.pid in on_gpus:
        return "NVML lists it on our GPUs"
    if state.in_nvidia_driver:
        return "waits in the NVIDIA driver"
    return ""


def confirm_gpus_free(
    probe: GpuProbe,
    gpus: tuple[int, ...],
    threshold_mib: int,
    timeout_s: float,
    clock: Clock,
    log: Logger,
    own: Mapping[int, int] | None = None,
) -> bool | None:
    """Wait up to `timeout_s` for the stopped tree's GPU memory to come back; None when NVML cannot say.
    `own`: MiB per GPU that stays by design (the deployment's weight holder's, which outlives its engine).
    `clock`: one whose sleep a second stop signal does not cut short (the reactor's `steady_clock`): the stop
    path finishes even then."""
    start = clock.monotonic()

    def busy_note(busy: list[GpuMemory], elapsed: float) -> None:
        log.info("stop.gpu_wait", gpus=",".join(str(m.index) for m in busy), waited_s=round(elapsed, 1))

    try:
        busy = wait_until_free(
            probe, gpus, threshold_mib, clock, timeout_s, GPU_POLL_S, busy_note, GPU_REPORT_EVERY_S, own
        )
    except GpuUnavailable as exc:
        log.warning("stop.gpu_unknown", error=str(exc))
        return None
    took = round(clock.monotonic() - start, 3)
    if busy:
        log.warning(
            "stop.gpu_still_busy", seconds=took, gpus=", ".join(f"GPU {m.index}: {m.used_mib} MiB" for m in busy)
        )
    else:
        log.info("stop.gpu_released", seconds=took, gpus=",".join(map(str, gpus)))
    return not busy
