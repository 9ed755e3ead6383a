"""Forwarding (docs/front.md, Routes and Retry): a request and its answer passed through to the engine that
serves, both bodies streamed; and a non-streamed completion, sent again when a restart broke it."""

from __future__ import annotations

from aiohttp import web

from kimi_supervisor.deployment.front.context import (
    FrontContext,
    error_response,
    outcome,
    pass_on,
    passed_headers,
    read_answer,
    request_headers,
)
from kimi_supervisor.deployment.front.engine import BASE
from kimi_supervisor.deployment.front.failure import EngineBroke, Failures
from kimi_supervisor.deployment.front.routes import Route


class Forwarder:
    def __init__(self, ctx: FrontContext, failures: Failures) -> None:
        self.ctx = ctx
        self.failures = failures

    async def forward(self, request: web.Request, route: Route) -> web.StreamResponse:
        """Pass the request and its answer through, both bodies streamed; a break is a 502 (or a cut body)."""
        probe = route is Route.PROBE
        engine = self.ctx.engines.pick()
        target = BASE + request.raw_path  # the request target as the client sent it, query included
        data = request.content.iter_any() if request.body_exists else None
        response: web.StreamResponse | None = None
        try:
            async with (
                self.failures.connection(engine, marks=not probe),
                engine.session.request(
                    request.method, target, headers=request_headers(request), data=data, allow_redirects=False
                ) as answer,
            ):
                response = web.StreamResponse(
                    status=answer.status, reason=answer.reason, headers=passed_headers(answer.headers)
                )
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        except EngineBroke as exc:
            if response is not None:
                raise  # headers went out: cutting the body is the one honest answer left
            if probe:
                return error_response(503, f"the engine does not answer ({exc.why})", "engine_unavailable")
            self.ctx.metrics.finished("failed_restart")
            return error_response(502, f"the engine went away ({exc.why})", "engine_restart")
        if not probe:  # a monitor's polling is not client traffic
            self.ctx.metrics.finished(outcome(request, "forwarded"))
        return response

    async def retrying(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """A non-streamed completion: vLLM sends its answer whole at the end, so one broken before it is sent
        again; the answer is read whole (one JSON document) so that a break inside it can be retried too, up to
        `max_body_bytes`: past that, or when it is a stream after all, it is passed on as it comes (`pass_on`)."""
        ctx = self.ctx
        for attempt in range(ctx.cfg.max_attempts):
            refused = await ctx.hold(request)
            if refused is not None:
                return refused
            engine = ctx.engines.pick()
            passing = False
            try:
                async with (
                    self.failures.connection(engine),
                    engine.session.post(BASE + request.raw_path, data=body, headers=request_headers(request)) as answer,
                ):
                    kept, whole = await read_answer(answer, ctx.cfg.max_body_bytes)
                    if not whole:
                        # Passed on as it comes: a break from here on cuts it (no retry).
                        passing = True
                        response = await pass_on(request, answer, kept)
                        ctx.metrics.finished(outcome(request, "forwarded" if attempt == 0 else "retried"))
                        return response
                    await self.failures.answer(engine, answer.status)
                    ctx.metrics.finished(outcome(request, "forwarded" if attempt == 0 else "retried"))
                    return web.Response(status=answer.status, body=kept, headers=passed_headers(answer.headers))
            except EngineBroke as exc:
                if passing:
                    raise  # part of the answer went out: cutting it is the one honest answer left
                ctx.log.warning("front.retry", path=request.path, attempt=attempt + 1, why=exc.why)
        ctx.metrics.finished("failed_restart")
        return error_response(503, f"the engine broke this request {ctx.cfg.max_attempts} times", "engine_restart")
