"""The front's aiohttp application (docs/front.md): each request routed to what handles it.

Every wake-up of the front's process is a task of its one asyncio loop: the handlers (forward.py, streams.py),
and the watch (watch.py) that probes the engines over their sockets and reads their supervisors' state files.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.bodies import HeldBodies, Parser, is_stream, read_kept, refused_coding
from kimi_supervisor.deployment.front.context import FrontContext, error_response
from kimi_supervisor.deployment.front.engine import Engine, EnginePool
from kimi_supervisor.deployment.front.failure import Failures
from kimi_supervisor.deployment.front.forward import Forwarder
from kimi_supervisor.deployment.front.gate import EngineGate
from kimi_supervisor.deployment.front.metrics import FrontMetrics
from kimi_supervisor.deployment.front.records import EngineRecords, hold_bound
from kimi_supervisor.deployment.front.routes import RESUMABLE, Route, route_of
from kimi_supervisor.deployment.front.streams import Streams
from kimi_supervisor.deployment.front.watch import EngineWatch
from kimi_supervisor.logs.types import Logger


class FrontServer:
    def __init__(self, cfg: FrontConfig, log: Logger) -> None:
        self.cfg = cfg
        self.log = log
        engines = [Engine("main", cfg.engine_socket, cfg.probe_timeout_s, EngineRecords.of(cfg))]
        if cfg.spare_socket is not None:  # the hot spare: one more engine, after the preferred one (docs/spare.md)
            records = EngineRecords(cfg.spare_state_file, cfg.spare_history_file, cfg.engine_holder_state_file)
            engines.append(Engine("spare", cfg.spare_socket, cfg.probe_timeout_s, records))
        self.engines = EnginePool(engines)
        self.gate = EngineGate(self.engines, cfg.queue_max, hold_bound(cfg).seconds)
        self.metrics = FrontMetrics(cfg.deployment)
        # Read at each scrape: what waits now, and whether an engine serves now.
        self.metrics.held.set_function(lambda: self.gate.held)
        self.metrics.serving.set_function(lambda: int(self.engines.serving))
        for engine in self.engines.engines:
            self.metrics.serving_engine.labels(cfg.deployment, engine.name).set_function(self._serves(engine))
        self._ctx = ctx = FrontContext(cfg, log, self.metrics, self.engines, self.gate)
        failures = Failures(self.engines)
        self.watch = EngineWatch(ctx)
        self.forwarder = Forwarder(ctx, failures)
        self.streams = Streams(ctx, failures)
        self.held_bodies = HeldBodies(cfg.max_held_bytes)
        self.parser = Parser()

    def _serves(self, engine: Engine) -> Callable[[], int]:
        """1 while new requests go to `engine` (its series of kimi_front_serving_engine), read at each scrape."""
        return lambda: int(self.engines.serving_engine is engine)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def runner(self, shutdown_timeout: float = 10.0) -> web.AppRunner:
        # A client that disconnects cancels its handler: the engine's connection for it closes with it, and
        # vLLM aborts the request (its with_cancellation / StreamingResponse see the disconnect).
        # auto_decompress=False: a coded body is refused, never decoded (bodies.py).
        return web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
            auto_decompress=False,
        )

    async def _start(self, _: web.Application) -> None:
        for engine in self.engines.engines:
            engine.open()
        self.watch.start()

    async def _stop(self, _: web.Application) -> None:
        await self.watch.stop()
        for engine in self.engines.engines:
            await engine.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.rel_url.raw_path
        route = route_of(raw, self.cfg.allow_routes)
        if route is Route.REFUSED:
            self.metrics.finished("refused_route")
            return error_response(
                403,
                f"{raw}: not forwarded by the front (allow it with front.allow_routes = [{json.dumps(raw)}])",
                "forbidden_route",
            )
        if route is Route.FRONT:
            if raw == "/front/metrics":
                return web.Response(body=self.metrics.text(), content_type="text/plain")
            return web.json_response({"engine_serving": self.engines.serving, "held": self.gate.held})
        refused = refused_coding(request)
        if refused is not None:
            self.metrics.finished("refused_coding")
            return refused
        if route is Route.RESUMABLE and request.method == "POST":
            return await self._resumable(request, RESUMABLE[raw])
        if route is not Route.PROBE:
            refused = await self._ctx.hold(request)
            if refused is not None:
                return refused
        return await self.forwarder.forward(request, route)

    async def _resumable(self, request: web.Request, fmt: str) -> web.StreamResponse:
        """A completion: streamed ones are resumed after a break (streams.py), the others sent again (forward.py).
        Its body is kept, counted in `held_bodies`, until it is answered."""
        body, refused = await read_kept(request, self.cfg.max_body_bytes, self.held_bodies, self.gate.retry_after_s())
        if refused is not None:
            self.metrics.finished("rejected_too_large" if refused.status == 413 else "rejected_held_bytes")
            return refused
        try:
            parsed = await self.parser.parse(body)
            if parsed is not None and is_stream(parsed):
                return await self.streams.stream(request, fmt, parsed)
            return await self.forwarder.retrying(request, body)
        finally:
            self.held_bodies.give(len(body))
