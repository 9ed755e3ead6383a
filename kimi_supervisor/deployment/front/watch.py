"""The front's view of its engines (docs/front.md, Metrics and status): a task of the front's loop that probes
each engine (engine.py) every probe interval, or at once after a request saw one break; the outages it sees
begin and end (their kind from the engine's records, outages.py); the front's headline and its state file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from kimi_supervisor import __version__
from kimi_supervisor.deployment.front import outages
from kimi_supervisor.deployment.front.context import FrontContext
from kimi_supervisor.deployment.front.engine import Engine, Failover
from kimi_supervisor.deployment.front.metrics import SpareReadiness
from kimi_supervisor.opsview.statefile import StateFile, process_start_time


class EngineWatch:
    def __init__(self, ctx: FrontContext) -> None:
        self.ctx = ctx
        ctx.engines.on_change = self._serving_changed  # its one listener: outages begin and end here
        ctx.engines.on_failover = self._failed_over
        self.spare = SpareReadiness(ctx.cfg.spare_alert_s)
        self._stale_said: set[str] = set()  # spares whose stale key was logged (once per stretch)
        path = ctx.cfg.state_file
        self._state = None if path is None else StateFile(path.parent, ctx.log, path.name)
        pid = os.getpid()
        config = "" if ctx.cfg.config_file is None else str(ctx.cfg.config_file)
        self._writer = {"pid": pid, "start_time": process_start_time(pid), "version": __version__, "config": config}
        self._started = time.time()
        self._ready_at: float | None = None  # its first state written as ready: it listens (serve.py, READY=1)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        engines = self.ctx.engines
        while True:
            for engine in engines.engines:
                engines.mark(engine, await engine.probe() and self._same_tokens(engine))
            self.spare_seen(time.monotonic())
            self.write_state()
            engines.probe_now.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(engines.probe_now.wait(), self.ctx.cfg.probe_interval_s)

    def _same_tokens(self, engine: Engine) -> bool:
        """A spare serves only while what decides its tokens is its engine's (docs/spare.md): an engine restarted
        with an edited argv while the spare runs its old one would answer otherwise.  Unknown keys (no live
        supervisor's record) are not counted as a difference."""
        main = self.ctx.engines.main
        if engine is main:
            return True
        mine, theirs = engine.records.output_key(), main.records.output_key()
        if mine is None or theirs is None or mine == theirs:
            self._stale_said.discard(engine.name)
            return True
        if engine.name not in self._stale_said:
            self._stale_said.add(engine.name)
            self.ctx.log.warning(
                "front.spare_stale",
                engine=engine.name,
                spare_key=mine[:12],
                engine_key=theirs[:12],
                why="its argv is not the engine's since the engine's config changed: restart the spare's unit",
            )
        return False

    def spare_seen(self, now: float) -> None:
        """After each probe round: whether a hot spare is ready, and for how long none has been (docs/spare.md)."""
        engines, metrics = self.ctx.engines, self.ctx.metrics
        if not engines.spares:
            return  # no spare configured: the deployment works as without one, and its headline says so
        crossed = self.spare.update(any(e.serving for e in engines.spares), now)
        metrics.spare_ready.set(int(self.spare.ready))
        metrics.no_ready_spare_seconds.set(self.spare.without_s(now))
        metrics.no_ready_spare_alert.set(int(self.spare.alerting(now)))
        if crossed:
            self.ctx.log.warning(
                "front.no_ready_spare",
                seconds=round(self.spare.without_s(now), 1),
                bound_s=self.spare.alert_s,
                why="a crash now costs clients the engine's whole restart",
            )

    def _failed_over(self, failover: Failover) -> None:
        self.ctx.metrics.failover(failover.died, failover.to, failover.seconds, time.time())
        self.ctx.log.warning(
            "front.failover", died=failover.died, to=failover.to, first_request_s=round(failover.seconds, 3)
        )

    def _serving_changed(self, serving: bool) -> None:
        ctx = self.ctx
        if serving:
            self._outage_ended(time.time())
            ctx.log.info("front.engine_serving", held=ctx.gate.held)
        else:
            ctx.metrics.outage_began(time.time())
            ctx.log.warning("front.engine_unavailable", socket=str(ctx.engines.main.socket))

    def _outage_ended(self, now: float) -> None:
        """Its kind from the engine's records (outages.py), read once per outage."""
        metrics = self.ctx.metrics
        latest = metrics.outages_seen[-1] if metrics.outages_seen else None
        began = latest.get("began") if latest is not None and latest.get("ended") is None else None
        if not isinstance(began, (int, float)):  # the first sight of the engine serving: no outage ends
            metrics.outage_ended(now, None)
            return
        kind = outages.outage_kind(began, now, self.ctx.engines.main.records)
        metrics.outage_ended(now, kind)
        self.ctx.log.info("front.outage_ended", seconds=round(now - began, 3), **kind)

    def headline(self) -> str:
        """The front's one line (systemd's STATUS=, its state file's `status`)."""
        ctx = self.ctx
        serving = ctx.engines.serving_engine
        if serving is not None:
            if not ctx.engines.spares:
                spare = "no spare"
            elif self.spare.ready:
                spare = "spare ready"
            else:
                spare = f"no ready spare for {self.spare.without_s(time.monotonic()):.0f}s"
            who = "engine up" if serving is ctx.engines.main else f"engine down, {serving.name} serving"
            return f"serving: {who}, {ctx.cfg.host}:{ctx.cfg.port} ({spare})"
        eta = f", ETA ~{ctx.gate.retry_after_s()}s" if ctx.engines.eta_s is not None else ""
        return f"holding {ctx.gate.held} request(s): engine not serving{eta}"

    def write_state(self, phase: str = "ready", exit_code: int | None = None) -> None:
        """Its state file for `status` (opsview/statefile.py's schema; the front's numbers under `front`)."""
        if self._state is None:
            return
        ctx = self.ctx
        now = time.time()
        if phase == "ready" and self._ready_at is None:
            self._ready_at = now
        doc: dict[str, Any] = {
            "schema": 1,
            "supervisor": self._writer,
            "phase": phase,
            "status": self.headline() if phase == "ready" else phase,
            "since": self._started,
            "started_at": self._started,
            "ready_at": self._ready_at,
            "updated_at": now,
            "ended_at": now if phase == "stopped" else None,
            "exit_code": exit_code,
            "front": {
                "engine_serving": ctx.engines.serving,
                "held": ctx.gate.held,
                "hold_s": ctx.gate.hold_s,
                "requests": dict(ctx.metrics.counts),
                "outages": list(ctx.metrics.outages_seen),
                # Which engine new requests go to, and the hot spare's side (docs/spare.md).
                "serving_engine": None if ctx.engines.serving_engine is None else ctx.engines.serving_engine.name,
                "spare": {
                    "configured": bool(ctx.engines.spares),
                    "ready": self.spare.ready,
                    "without_ready_s": round(self.spare.without_s(time.monotonic()), 1),
                    "alert_s": self.spare.alert_s,
                    "failovers": list(ctx.metrics.failovers_seen),
                },
            },
        }
        self._state.write(doc)
