"""The lifecycle, top to bottom: preflight, spawn, wait for ready, serve, stop.

Like gunicorn's arbiter: signal handlers only record, this loop acts.  One
thread owns all state; the health prober thread only produces results.  Every
wait of that thread is a turn of the one reactor (reactor.py): signals, the
child's output, its exit (a pidfd), the prober's wake-ups and timers wake it;
what the reactor calls only records, the loops here act on what was recorded.  Every
failure is a SupervisorError carrying its exit code; `run` stops the child
tree before letting it reach `cli.main`, and so does every other way out
(a bug, KeyboardInterrupt, SystemExit, a broken pipe, psutil.AccessDenied, a
lost GPU): the tree never outlives the supervisor.  The child's output is
output.ChildOutput's business, end to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from kimi_supervisor.checks import Verdict
from kimi_supervisor.child.cachedirs import CacheUntrusted
from kimi_supervisor.child.lines import LineClassifier, answered_ok
from kimi_supervisor.child.output import ChildOutput
from kimi_supervisor.child.process import Child, PreparedSpawn
from kimi_supervisor.child.readiness import LineEvent, ReadinessTracker
from kimi_supervisor.child.spawnplan import Unresolvable
from kimi_supervisor.clock import Clock, format_duration
from kimi_supervisor.config.gpu_pinning import ras_address
from kimi_supervisor.config.model import Config
from kimi_supervisor.config.vllm_args import served_at
from kimi_supervisor.exitcodes import (
    ChildDied,
    ChildUnhealthy,
    ConfigError,
    ExitCode,
    StartupFailed,
    StartupStalled,
    SupervisorError,
    exit_outcome,
)
from kimi_supervisor.host.gpu import configured_gpus, pin_configured_gpus
from kimi_supervisor.host.readahead import ReadAhead
from kimi_supervisor.lifecycle.deps import Deps, Liveness, Prober
from kimi_supervisor.lifecycle.drain import stopped_headline
from kimi_supervisor.lifecycle.machine import StateMachine
from kimi_supervisor.lifecycle.signals import StopRequested
from kimi_supervisor.lifecycle.stopping import TreeStopper, confirm_gpus_free, unkillable
from kimi_supervisor.liveness.engine import LivenessInputs
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.opsview import forensics
from kimi_supervisor.opsview.view import OperatorView
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.quoting import quote
from kimi_supervisor.states import State
from kimi_supervisor.systemd.notify import Watchdog

EXTEND_EVERY_S = 5.0  # EXTEND_TIMEOUT_USEC at most this often while output flows
EXTEND_MARGIN_S = 15.0
# Once vLLM says it started, /health answers within moments: probe it this often (for at most
# READY_BURST_S) so READY=1 follows the first 200 by tens of ms, not a whole poll interval.
READY_PROBE_S = 0.02
READY_BURST_S = 10.0
# The longest a turn waits while starting: every event (a line, the exit, a probe's result, a signal) ends it at
# once; this bound is how often the load is sampled for the ETA (opsview/view.py: OBSERVE_EVERY_S) and the
# stall, deadline and STATUS= clocks are looked at.
STARTING_TURN_S = 0.25
# Stops the supervisor decides on while the tree still runs: where it hung is in it (opsview/forensics.py).
INCIDENT_CODES = frozenset(
    {
        ExitCode.STARTUP_STALLED,
        ExitCode.CHILD_UNHEALTHY,
        ExitCode.ENGINE_WEDGED,
        ExitCode.GPU_FAILED,
        ExitCode.PEER_LOST,
    }
)
# Systemd's watchdog kill is coming this soon: long enough for the capture's budget and a turn of the loop.
WATCHDOG_LEAD_S = forensics.BUDGET_S + 1.0


class Supervisor:
    def __init__(self, cfg: Config, deps: Deps, secrets: tuple[str, ...] = ()) -> None:
        self.cfg = cfg
        self.log = deps.log
        self.signals = deps.signals
        self.reactor = deps.reactor
        self.clock: Clock = deps.clock if deps.clock is not None else deps.reactor.clock
        self.tracker = ReadinessTracker(cfg.readiness)
        # State file, history, ETA, metrics: fed by the state machine, what we tell systemd, and the loop.
        self.view = OperatorView(
            cfg,
            deps.probe,
            deps.log,
            self.tracker,
            deps.watchdog_s,
            table=deps.table,
            wall=deps.wall,
            mono=self.clock.monotonic,
        )
        self.deps = deps = dataclasses.replace(deps, notifier=self.view.tap(deps.notifier))
        self.state = StateMachine(deps.notifier, deps.log, observer=self.view)
        self.child: Child | None = None
        self.stopper: TreeStopper | None = None  # from the spawn on: every way out stops the tree
        self.prober: Prober | None = None
        self._prepared: PreparedSpawn | None = None
        self.readahead: ReadAhead | None = None  # [readahead]: the shards read ahead of vLLM (host/readahead.py)
        self.deep: Liveness | None = None
        self.output = ChildOutput(deps.sink, self.tracker, deps.log, secrets, clock=self.clock, reactor=self.reactor)
        self._exited_at: float | None = None  # when the reactor saw the child's exit (its pidfd)
        self._last_extend = 0.0
        self._last_said = 0.0
        self._started_at = 0.0
        self.incident: str | None = None  # this run's incident file (forensics.py), named in its failure

    # -- the lifecycle ------------------------------------------------------------

    def run(self) -> ExitCode:
        self.signals.install()
        self.deps.threads.install(self.reactor.wake)
        try:
            return self._run()
        except BaseException as exc:
            if self.stopper is not None and not self.stopper.stopped and not self.stopper.survivors:
                self._emergency_stop(exc, self.stopper)
            self._record_exit(exc)
            raise
        finally:
            self.reactor.remove_turn_hook(self.view.tick)
            self._end_readahead("the run ended")
            if self.prober is not None:
                self.prober.stop()
            if self.deep is not None:
                self.deep.close()
            self.deps.threads.uninstall()
            self.signals.uninstall()

    def _run(self) -> ExitCode:
        try:
            try:
                self._prepare_child()  # a start that cannot happen kills nothing
                self.deps.role.before_preflight(self)  # before the preflight touches anything
                self._start_readahead()  # while the preflight waits for GPUs and vLLM imports
                self._preflight()
                self._spawn()
                if self._wait_until_ready():
                    self._serve()
            except StopRequested:
                pass
            self._stop("stop requested", requested=True)
            self.state.to(State.STOPPED, "stopped")
            return ExitCode.OK
        except SupervisorError as err:
            if self.state.state is not State.STOPPING and self.child is not None:
                if err.exit_code in INCIDENT_CODES:  # before the stop: the evidence dies with the tree
                    self._record_incident(err.message, int(err.exit_code))
                self._stop(err.message)
            self.state.to(
                State.FAILED, f"failed: {err.message}"[:400], exit_code=int(err.exit_code), **self._incident_field()
            )
            raise

    def _prepare_child(self) -> None:
        child = pin_configured_gpus(self.cfg.child, self.cfg.preflight.gpus, self.deps.probe)
        self.cfg = dataclasses.replace(self.cfg, child=child)
        try:
            self._prepared = self.deps.spawn.prepare(self.cfg.child, self.deps.environ)
        except Unresolvable as exc:
            raise ConfigError(f"{self.cfg.path}: child.{exc.key}: {exc.message}") from None
        except CacheUntrusted as exc:
            raise CacheUntrusted(f"{self.cfg.path}: {exc.message}") from None
        note = self._prepared.cache_note if self._prepared is not None else None
        if note is not None:
            self.log.warning("cache.defaults", why=note, effect="vLLM's compile cache follows HOME (cachedirs.py)")
        self.deps.role.prepare_child(self.cfg, self._prepared, self.log)

    def _start_readahead(self) -> None:
        model = self.cfg.child.vllm.model
        if not self.cfg.readahead.enabled or not model or not model.startswith("/"):
            return
        self.readahead = ReadAhead.for_model(Path(model), self.cfg.readahead.shards_ahead)
        if self.readahead is not None:
            self.readahead.start()
            self.log.info("readahead.started", model=model, shards_ahead=self.cfg.readahead.shards_ahead)

    def _end_readahead(self, reason: str) -> None:
        ra, self.readahead = self.readahead, None
        if ra is None:
            return
        ra.finish(reason)
        ended = ra.join(5.0)  # within one 16 MiB read
        self.log.info(
            "readahead.stopped",
            reason=ra.reason,
            shards_read=ra.shards_read,
            bytes_read=ra.bytes_read,
            memory_waits=ra.memory_waits,
            thread_ended=ended,
        )

    def _preflight(self) -> None:
        pf = self.cfg.preflight
        self.state.enter_initial("preflight: checking GPUs, stale processes and shared memory")
        # Waiting for GPUs may take longer than TimeoutStartSec's default.
        self.deps.notifier.send(EXTEND_TIMEOUT_USEC=usec(pf.deadline_s + pf.reap.grace_s + EXTEND_MARGIN_S))
        report = Preflight(self.cfg, self.deps.probe, self.deps.table, self.clock, self.log).run(dry_run=False)
        self.log.info("preflight.passed", checks=len(report.checks))
        done = [c.name for c in report.checks if c.verdict is Verdict.DONE]
        self.view.on_preflight(kills=done.count("reap"), shm_removed=done.count("shm"))

    def _spawn(self) -> None:
        if self.stop_signalled():
            raise StopRequested
        self.view.before_spawn()  # how much of the model the page cache holds as vLLM starts
        self.child = self.deps.spawn.spawn(self.cfg.child, self.deps.environ, self._prepared)
        self.stopper = TreeStopper(self.child, self.reactor, self.output, self.log)
        self._started_at = self._now()
        self.output.attach(self.child)
        self.reactor.add_turn_hook(self.view.tick)  # after the output's: the view sees this turn's lines
        self.reactor.watch_exit(self.child, self._on_exit)
        self.output.on_output = self._on_output
        self.output.on_line = self._on_line
        self.state.to(State.STARTING, "starting: vLLM spawned", pid=self.child.pid)
        self._extend_timeout(self._now())
        self.prober = self.deps.prober(
            self.cfg.readiness.health_url,
            self.cfg.health.timeout_s,
            self.cfg.readiness.poll_interval_s,
            self.reactor.wake,
        )
        self.prober.start()

    def _wait_until_ready(self) -> bool:
        """True once the log says started AND /health answered 200; False on a stop request."""
        rcfg = self.cfg.readiness
        assert self.child is not None and self.prober is not None
        healthy: HealthResult | None = None
        last_error: str | None = None
        while True:
            self.reactor.run_once(STARTING_TURN_S)
            if self.stop_signalled():
                return False
            now = self._now()
            self._check_child(serving=False)
            self.deps.threads.check()
            for result in self.prober.new_results():
                self.view.on_health(result)
                healthy = result if result.ok else None
                if result.error != last_error and result.error is not None:
                    # Each new reason once ("connection refused" while vLLM loads is normal, a timeout is not).
                    self.log.info("health.not_yet", error=result.error, phase=self.tracker.phase)
                last_error = result.error
            if self.tracker.server_started and healthy is not None:
                self._ready(now)
                return True
            if now - self.output.last_output > rcfg.stall_timeout_s:
                raise StartupStalled(
                    f"vLLM printed nothing for {rcfg.stall_timeout_s:g}s "
                    f"(readiness.stall_timeout_s) while {self.tracker.phase}",
                    detail=self._tail(),
                )
            if now - self._started_at > rcfg.deadline_s:
                raise StartupStalled(
                    f"vLLM not ready after {rcfg.deadline_s:g}s (readiness.deadline_s) while {self.tracker.phase}"
                    + (f" (last /health: {last_error})" if last_error else ""),
                    detail=self._tail(),
                )
            if now - self._last_said >= 5.0:
                self._say_progress(now)

    def _check_child(self, serving: bool) -> None:
        """Raise when vLLM logged a fatal line or exited: the same two checks while starting and serving."""
        assert self.child is not None
        error = ChildDied if serving else StartupFailed
        if self.tracker.fatal_line is not None:
            # After READY too: vLLM's own main lingers for seconds after its engine died, answering 503.
            what = "reported a fatal error after it was ready" if serving else "failed while starting"
            # The rest of the fatal record (its traceback, whose exception is the root cause) is usually in
            # the pipe already: read what is there, without waiting.
            self.reactor.run_once(0)
            raise error(f"vLLM {what}: {self._root_cause()}", detail=self._tail())
        # The reactor saw its pidfd (`_on_exit`) or, between two turns, the exit came first: poll reaps it either way.
        status = self.child.poll()
        if self._exited_at is not None or status is not None:
            self.reactor.run_once(0)
            when = "after it was ready (not requested)" if serving else "before it was ready"
            raise error(f"vLLM exited with status {status} {when}: {self._root_cause()}", detail=self._tail())

    def _ready(self, now: float) -> None:
        self._end_readahead("vLLM is ready")
        self.tracker.serving = True  # from now on only fatal lines matter
        self.output.on_line = self.output.on_output = None
        took = format_duration(now - self._started_at)
        self.state.to(
            State.READY,
            f"{self._serving_headline()} (started in {took})",
            notify={"READY": 1},
            startup_s=round(now - self._started_at, 3),
        )

    def _serve(self) -> None:
        """Supervise until a stop signal; raise when the child dies or stays unhealthy."""
        assert self.child is not None and self.prober is not None
        hcfg = self.cfg.health
        self.prober.set_interval(hcfg.interval_s)
        self.child.refresh_members()
        gpus = configured_gpus(self.deps.probe, self.cfg.preflight.gpus)
        self.deep = self.deps.liveness(
            LivenessInputs(
                self.cfg,
                self.deps.probe,
                gpus,
                self.reactor.wake,
                self.deps.notifier,
                self.log,
                self.deps.environ,
                on_canary=self.view.on_canary,
                http=self.deps.http,
            )
        )
        self.deep.start()
        wd = self.deps.watchdog_s
        if wd and hcfg.interval_s + hcfg.timeout_s >= wd:
            # A passing probe must land within every watchdog period, or systemd kills a healthy server.
            self.log.warning(
                "watchdog.too_short", watchdog_s=wd, health_interval_s=hcfg.interval_s, health_timeout_s=hcfg.timeout_s
            )
        failures = 0
        watchdog = Watchdog(wd, self.deps.notifier, last_ok=self._now())  # the probe that made us ready
        watchdog_evidence = False
        while True:
            self.reactor.run_once(watchdog.wait_s(self._now(), healthy=failures == 0 and self.deep.healthy))
            if self.stop_signalled():
                return
            self._check_child(serving=True)
            self.deps.threads.check()  # a dead canary or prober thread: exit 70, never a watchdog pinged blind
            for result in self.prober.new_results():
                self.view.on_health(result)
                if result.ok:
                    if failures:
                        self.log.info("health.recovered", after_failures=failures)
                        self.state.say(self._serving_headline())
                    failures, watchdog.last_ok = 0, result.at
                    continue
                failures += 1
                self.log.warning(
                    "health.failed", failures=failures, tolerated=hcfg.failures_tolerated, error=result.error
                )
                self.deps.notifier.send(
                    STATUS=f"ready, but /health failing ({failures}/{hcfg.failures_tolerated}): {result.error}"
                )
                if failures >= hcfg.failures_tolerated:
                    raise ChildUnhealthy(
                        f"/health failed {failures} times in a row ({result.error})", detail=self._tail()
                    )
            self.deep.check()  # canary, token progress, GPU events: raises EngineWedged / GpuFailed
            watchdog.pet(self._now(), healthy=failures == 0 and self.deep.healthy)
            fires_in = watchdog.fires_in(self._now())
            if fires_in is not None and fires_in <= WATCHDOG_LEAD_S and not watchdog_evidence:
                # systemd's SIGABRT follows: the evidence now, while the hung tree still runs; once a run.
                watchdog_evidence = True
                why = f"systemd's watchdog fires in {fires_in:.1f}s: no WATCHDOG=1 (WatchdogSec={watchdog.period_s:g})"
                self._record_incident(why, None)
                self.view.on_incident(self.incident)

    def _stop(self, reason: str, requested: bool = False) -> None:
        """TERM the tree, keep reading its output, KILL what outlives the grace, confirm GPUs are free."""
        scfg = self.cfg.shutdown
        if self.deep is not None:
            self.deep.stop()  # no canary or GPU verdict about a tree being stopped
        drain = None
        # A serving vLLM may have requests in flight; a role whose child serves none does not drain.
        if requested and self.state.state is State.READY and self.deps.role.drains:
            drain = self.deps.drain(
                self.cfg.readiness.health_url,
                self.cfg.child.vllm.shutdown_timeout,
                self.deps.notifier,
                self.log,
                http=self.deps.http,
                clock=self.clock.monotonic,
            )
            if drain is not None and self.deep is not None:
                drain.liveness_sample = self.deep.in_flight_sample()  # no read: it cannot delay the SIGTERM
        if self.state.state is not State.STOPPING:
            self.state.to(State.STOPPING, f"stopping: {reason}"[:400], notify={"STOPPING": 1})
        if self.stopper is None:
            return  # stopped during the preflight: nothing of ours holds a GPU
        tree_gone = self.stopper.stop(scfg.grace_s, scfg.second_signal_grace_s, drain)
        self.reactor.remove_turn_hook(self.view.tick)  # the tree's turns only, as ever: not the GPU wait's
        gpus = configured_gpus(self.deps.probe, self.cfg.preflight.gpus)
        # Outlived SIGKILL: its GPUs never free, so no GPU wait and an exit the unit does not restart on.
        stuck = unkillable(self.stopper.survivors, self.deps.table, self.deps.probe, gpus, self.log, reason)
        if stuck is not None:
            raise stuck
        gpus_free = None
        if gpus and scfg.gpu_release_timeout_s > 0:
            threshold = self.cfg.preflight.memory_threshold_mib
            # The weight holder outlives its engine by design: what it holds is not the engine's to wait for.
            own = self.deps.role.own_memory(self.cfg, self.deps.table, self.deps.probe, gpus)
            gpus_free = confirm_gpus_free(
                self.deps.probe, gpus, threshold, scfg.gpu_release_timeout_s, self.reactor.steady_clock, self.log, own
            )
        self.state.say(stopped_headline(tree_gone, gpus_free, drain.outcome if drain is not None else None))

    def _emergency_stop(self, exc: BaseException, stopper: TreeStopper) -> None:
        """Something other than a SupervisorError is ending the run: stop the tree before it propagates."""
        reason = f"{type(exc).__name__}: {exc}"[:300]
        with contextlib.suppress(BaseException):
            self.log.error("supervisor.emergency_stop", error=reason, state=self.state.state.value)
        with contextlib.suppress(BaseException):
            if self.state.state is not State.STOPPING:
                self.state.to(State.STOPPING, f"stopping: {reason}"[:400], notify={"STOPPING": 1})
        stopper.emergency(self.cfg.shutdown.grace_s, self.cfg.shutdown.second_signal_grace_s)

    def _record_exit(self, exc: BaseException) -> None:
        """The state file and the history say how this run ended, whatever ended it (never "killed?").

        A SupervisorError was recorded by `_run`; anything else gets the exit code cli.main will give it.
        """
        if self.state.state in (State.STOPPED, State.FAILED):
            return
        code, reason = exit_outcome(exc)
        with contextlib.suppress(BaseException):  # the exception that ends the run must reach cli.main
            # STOPPED is reached only through STOPPING, and READY cannot fail directly (state.ALLOWED).
            if (code == 0 or self.state.state is State.READY) and self.state.state is not State.STOPPING:
                self.state.to(State.STOPPING, f"stopping: {reason}"[:400], notify={"STOPPING": 1})
            if code == 0:
                self.state.to(State.STOPPED, f"stopped: {reason}"[:400], exit_code=int(code), root_cause=reason)
            else:
                self.state.to(State.FAILED, f"failed: {reason}"[:400], exit_code=int(code), **self._incident_field())

    def _record_incident(self, reason: str, exit_code: int | None) -> None:
        """Every member's Python stacks, our GPUs and the last /metrics sample, bounded by forensics.BUDGET_S.
        `exit_code`: the stop's; None for the watchdog's coming kill."""
        if self.child is None:
            return
        procs = []
        for member in self.child.alive_members():
            info = self.deps.table.get(member.pid)
            procs.append((member.pid, info.name if info is not None else "?"))
        try:
            scene = forensics.Scene(
                reason,
                exit_code,
                procs,
                self.deps.probe,
                configured_gpus(self.deps.probe, self.cfg.preflight.gpus),
                self.deep.in_flight_sample() if self.deep is not None else None,
                ras_address(self.cfg.child.env),
            )
            self.incident = forensics.record(
                forensics.store_for(self.cfg),
                scene,
                self.deps.dumper,
                clock=self.reactor.steady_clock.monotonic,
                wall=self.deps.wall,
                log=self.log,
            )
        except Exception as exc:  # evidence is best effort: a bug here must not change the stop or its exit code
            self.log.error("incident.failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def _incident_field(self) -> dict[str, Any]:
        return {"incident": self.incident} if self.incident else {}

    # -- the event loop -------------------------------------------------------------

    def _on_exit(self) -> None:
        self._exited_at = self._now()  # recorded only: the loop's next look (`_check_child`) acts on it

    def _on_output(self, now: float) -> None:
        if self.state.state is State.STARTING:
            self._extend_timeout(now)
            if now - self._last_said >= 1.0:
                self._say_progress(now)

    def _on_line(self, now: float, event: LineEvent) -> None:
        if event.started and self.prober is not None and self.state.state is State.STARTING:
            self.prober.burst(READY_PROBE_S, READY_BURST_S)
        if event.phase_changed and self.state.state is State.STARTING:
            self._last_said = 0.0  # a new phase shows at once
        if self.readahead is not None:
            if event.progress_changed and self.tracker.progress is not None:
                self.readahead.progress(self.tracker.progress.done)
            if self.tracker.weights_loaded:
                self._end_readahead("vLLM's weights are loaded")

    def _say_progress(self, now: float) -> None:
        self._last_said = now
        elapsed = now - self._started_at
        rate = self.view.read_rate_text()
        self.state.say(f"starting: {self.tracker.headline(elapsed, self.view.eta_text(elapsed), rate)}")

    def _extend_timeout(self, now: float) -> None:
        if now - self._last_extend < EXTEND_EVERY_S:
            return
        self._last_extend = now
        rcfg = self.cfg.readiness
        left = max(0.0, rcfg.deadline_s - (now - self._started_at))
        self.deps.notifier.send(EXTEND_TIMEOUT_USEC=usec(min(rcfg.stall_timeout_s, left) + EXTEND_MARGIN_S))

    def notify(self, **fields: str | int) -> None:
        self.deps.notifier.send(**fields)

    def _now(self) -> float:
        return self.clock.monotonic()

    def stop_signalled(self) -> bool:
        return self.reactor.stop_signalled(self.state.state.value)

    # -- helpers -----------------------------------------------------------------------

    def _serving_headline(self) -> str:
        return f"ready: serving on {served_at(self.cfg.readiness.health_url)}"

    def _root_cause(self) -> str:
        # vLLM's line, maybe holding a client's words: quoted and escaped, never the supervisor's own text.
        return quote(self.tracker.root_cause())

    def _tail(self, lines: int = 15) -> list[str]:
        """The child's last lines for a failure's record (`supervisor.detail`, at error priority), without those of
        requests it answered fine (was: 11 of 15 `GET /health 200` lines after a crash while serving)."""
        classify = LineClassifier().classify_line
        telling = [line for line in self.tracker.tail if not answered_ok(classify(line))]
        return [line[:500] for line in telling[-lines:]]


def usec(seconds: float) -> int:
    return int(seconds * 1_000_000)
