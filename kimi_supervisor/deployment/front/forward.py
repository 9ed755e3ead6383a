"""Forwarding (docs/front.md, Routes and Retry): a request and its answer passed through to the engine that
serves, both bodies streamed; and a non-streamed completion, sent again when a restart broke it."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kimi_supervisor.deployment.front.context import (
    FrontContext,
    error_response,
    outcome,
    passed_headers,
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
        `max_body_bytes`: past that, or when it is a stream after all, it is passed on as it comes (`_passed`)."""
        ctx = self.ctx
        for attempt in range(ctx.cfg.max_attempts):
            refused = await ctx.hold(request)
            if refused is not None:
                return refused
            engine = ctx.engines.pick()
            passing: web.StreamResponse | None = None
            try:
                async with (
                    self.failures.connection(engine),
                    engine.session.post(BASE + request.raw_path, data=body, headers=request_headers(request)) as answer,
                ):
                    kept, whole = await self._kept(answer)
                    if not whole:
                        passing = web.StreamResponse(
                            status=answer.status, reason=answer.reason, headers=passed_headers(answer.headers)
                        )
                        return await self._passed(request, answer, passing, kept, attempt)
                    await self.failures.answer(engine, answer.status)
                    ctx.metrics.finished(outcome(request, "forwarded" if attempt == 0 else "retried"))
                    return web.Response(status=answer.status, body=kept, headers=passed_headers(answer.headers))
            except EngineBroke as exc:
                if passing is not None and passing.prepared:
                    raise  # part of the answer went out: cutting it is the one honest answer left
                ctx.log.warning("front.retry", path=request.path, attempt=attempt + 1, why=exc.why)
        ctx.metrics.finished("failed_restart")
        return error_response(503, f"the engine broke this request {ctx.cfg.max_attempts} times", "engine_restart")

    async def _kept(self, answer: aiohttp.ClientResponse) -> tuple[bytes, bool]:
        """The answer read up to `max_body_bytes`, and whether that is all of it.  Not all: one the front must not
        hold whole, a stream (a body too big to parse that asked for one) or an answer past the bound."""
        if answer.content_type == "text/event-stream":
            return b"", False
        limit = self.ctx.cfg.max_body_bytes
        if answer.content_length is not None and answer.content_length > limit:
            return b"", False
        parts: list[bytes] = []
        size = 0
        async for chunk in answer.content.iter_any():
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return b"".join(parts), False
        return b"".join(parts), True

    async def _passed(
        self,
        request: web.Request,
        answer: aiohttp.ClientResponse,
        response: web.StreamResponse,
        head: bytes,
        attempt: int,
    ) -> web.StreamResponse:
        """The answer passed on as it comes after `head` (what `_kept` read), never held whole: a break from here
        on cuts it (no retry)."""
        await response.prepare(request)
        if head:
            await response.write(head)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        self.ctx.metrics.finished(outcome(request, "forwarded" if attempt == 0 else "retried"))
        return response
