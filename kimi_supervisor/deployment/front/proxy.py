"""The front's aiohttp application (docs/front.md): forward, hold, retry, resume.

Every wake-up of the front's process is a task of its one asyncio loop: the handlers, and the watcher that
probes the engine's /health over its socket and reads its supervisor's state file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from kimi_supervisor import __version__
from kimi_supervisor.config.front import FrontConfig, hold_from_history
from kimi_supervisor.deployment.front import outages, sse
from kimi_supervisor.deployment.front.gate import EngineGate, QueueFull, last_load_s
from kimi_supervisor.deployment.front.metrics import FrontMetrics
from kimi_supervisor.deployment.front.resume import (
    GENERATE_PATH,
    RENDER_PATHS,
    NotResumable,
    StreamRecord,
    upstream_body,
)
from kimi_supervisor.deployment.front.routes import RESUMABLE, Kind, classify
from kimi_supervisor.deployment.front.upstream import BASE, BROKEN, Upstream
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview.statefile import StateFile, process_start_time, read_state, writer_alive
from kimi_supervisor.untrusted_json import Untrusted, parse_json

# RFC 9110 7.6.1's hop-by-hop fields, and the framing the two connections each set for themselves.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Content-Length",
        "Host",
    )
)
# The engine supervisor's phases in which new requests wait: it is draining, or not up yet.
_HOLDING_PHASES = frozenset({"preflight", "starting", "stopping", "stopped", "failed"})
_JSON_DEPTH = 64


class _Client:
    """One client's streamed answer, prepared with the first event the engine sends (a break before it leaves
    the client nothing to see yet)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def write(self, data: bytes, headers: dict[str, str]) -> None:
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers=headers)
            await self.response.prepare(self.request)
        await self.response.write(data)


class EngineBroke(Exception):
    """The engine went away under a request (a reset, a cut body, or its error chunk while /health fails)."""


_HELD = web.RequestKey("kimi_front.held", bool)  # this request waited for the engine (metrics: outcome "held")


def _outcome(request: web.Request, outcome: str) -> str:
    """What a request answered at last counts as: "held" for one that waited and then went through at once."""
    return "held" if outcome == "forwarded" and request.get(_HELD) else outcome


def _headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


def _error(status: int, message: str, kind: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Front:
    def __init__(self, cfg: FrontConfig, log: Logger) -> None:
        self.cfg = cfg
        self.hold_s = cfg.hold_s if cfg.hold_s is not None else hold_from_history(last_load_s(cfg.engine_history_file))
        self.log = log
        self.gate = EngineGate(cfg.queue_max)
        self.metrics = FrontMetrics(cfg.deployment)
        # Read at each scrape: what waits now, and whether the engine serves now.
        self.metrics.held.set_function(lambda: self.gate.held)
        self.metrics.serving.set_function(lambda: int(self.gate.serving))
        self._kick = asyncio.Event()
        self._upstream: Upstream | None = None
        self._watcher: asyncio.Task[None] | None = None
        path = cfg.state_file
        self._state = None if path is None else StateFile(path.parent, log, path.name)
        pid = os.getpid()
        self._writer = {"pid": pid, "start_time": process_start_time(pid), "version": __version__, "config": ""}
        self._started = time.time()

    @property
    def upstream(self) -> Upstream:
        assert self._upstream is not None, "the application has not started"
        return self._upstream

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def runner(self, shutdown_timeout: float = 10.0) -> web.AppRunner:
        # A client that disconnects cancels its handler: the engine's connection for it closes with it, and
        # vLLM aborts the request (its with_cancellation / StreamingResponse see the disconnect).
        return web.AppRunner(self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)

    async def _start(self, _: web.Application) -> None:
        self._upstream = Upstream(self.cfg.engine_socket, self.cfg.probe_timeout_s)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _stop(self, _: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.upstream.close()

    # The engine's state ------------------------------------------------------------------------------

    def _engine_phase(self) -> str | None:
        """The engine supervisor's phase and load ETA (gate.eta_s), or None without a live writer."""
        path = self.cfg.engine_state_file
        if path is None:
            return None
        try:
            doc = read_state(path)
        except (OSError, Untrusted):
            return None
        if doc is None or not writer_alive(doc):
            return None
        loading = doc.get("loading") or {}
        eta = loading.get("eta_s") if isinstance(loading, dict) else None
        self.gate.eta_s = float(eta) if isinstance(eta, (int, float)) else None
        phase = doc.get("phase")
        return phase if isinstance(phase, str) else None

    def headline(self) -> str:
        """The front's one line (systemd's STATUS=, its state file's `status`)."""
        gate = self.gate
        if gate.serving:
            return f"serving: engine up, {self.cfg.host}:{self.cfg.port}"
        eta = f", ETA ~{gate.retry_after_s(self.hold_s)}s" if gate.eta_s is not None else ""
        return f"holding {gate.held} request(s): engine not serving{eta}"

    def write_state(self, phase: str = "ready", exit_code: int | None = None) -> None:
        """Its state file for `status` (opsview/statefile.py's schema; the front's numbers under `front`)."""
        if self._state is None:
            return
        now = time.time()
        doc: dict[str, Any] = {
            "schema": 1,
            "supervisor": self._writer,
            "phase": phase,
            "status": self.headline() if phase == "ready" else phase,
            "since": self._started,
            "started_at": self._started,
            "updated_at": now,
            "ended_at": now if phase == "stopped" else None,
            "exit_code": exit_code,
            "front": {
                "engine_serving": self.gate.serving,
                "held": self.gate.held,
                "hold_s": self.hold_s,
                "requests": dict(self.metrics.counts),
                "outages": list(self.metrics.outages_seen),
            },
        }
        self._state.write(doc)

    async def _watch(self) -> None:
        while True:
            healthy = await self.upstream.healthy()
            serving = healthy and self._engine_phase() not in _HOLDING_PHASES
            self._set_serving(serving)
            self.write_state()
            self._kick.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.cfg.probe_interval_s)

    def _set_serving(self, serving: bool) -> None:
        if not self.gate.set_serving(serving):
            return
        if serving:
            self._outage_ended(time.time())
            self.log.info("front.engine_serving", held=self.gate.held)
        else:
            self.metrics.outage_began(time.time())
            self.log.warning("front.engine_unavailable", socket=str(self.cfg.engine_socket))

    def _outage_ended(self, now: float) -> None:
        """Its kind from the engine's history (outages.py), read once per outage."""
        latest = self.metrics.outages_seen[-1] if self.metrics.outages_seen else None
        began = latest.get("began") if latest is not None and latest.get("ended") is None else None
        if not isinstance(began, (int, float)):  # the first sight of the engine serving: no outage ends
            self.metrics.outage_ended(now, None)
            return
        kind = outages.classify(began, now, self.cfg.engine_history_file, self.cfg.engine_holder_state_file)
        self.metrics.outage_ended(now, kind)
        self.log.info("front.outage_ended", seconds=round(now - began, 3), **kind)

    def _engine_broke(self) -> None:
        """A request met a broken engine: hold new ones now, and probe at once rather than at the next tick."""
        self._set_serving(False)
        self._kick.set()

    async def _engine_down_now(self) -> bool:
        """After an error answer: is it the engine dying (its /health fails) rather than the request's fault?"""
        if await self.upstream.healthy():
            return False
        self._engine_broke()
        return True

    # Holding -----------------------------------------------------------------------------------------

    async def _hold(self, request: web.Request) -> web.Response | None:
        """None once the engine serves; else the 503 the request gets (queue full, or hold_s passed).  A request
        that waited is marked, so that it is counted `held` when it is answered (`_outcome`)."""
        if self.gate.serving:
            return None
        request[_HELD] = True
        began = time.monotonic()
        try:
            served = await self.gate.wait(self.hold_s)
        except QueueFull:
            self.metrics.finished("rejected_full")
            retry = self.gate.retry_after_s(self.hold_s)
            return _error(
                503,
                f"the engine is restarting and {self.gate.queue_max} requests wait already",
                "engine_restart",
                retry,
            )
        self.metrics.waited(time.monotonic() - began)
        if served:
            return None
        self.metrics.finished("rejected_timeout")
        retry = self.gate.retry_after_s(self.hold_s)
        return _error(503, f"the engine did not come back within {self.hold_s:g}s", "engine_restart", retry)

    # Requests ----------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.rel_url.raw_path
        kind = classify(raw, self.cfg.allow_routes)
        if kind is Kind.REFUSED:
            self.metrics.finished("refused_route")
            return _error(
                403,
                f"{raw}: not forwarded by the front (allow it with front.allow_routes = [{json.dumps(raw)}])",
                "forbidden_route",
            )
        if kind is Kind.FRONT:
            if raw == "/front/metrics":
                return web.Response(body=self.metrics.text(), content_type="text/plain")
            return web.json_response({"engine_serving": self.gate.serving, "held": self.gate.held})
        if kind is Kind.RESUMABLE and request.method == "POST":
            return await self._resumable(request, RESUMABLE[raw])
        if kind is not Kind.PROBE:
            refused = await self._hold(request)
            if refused is not None:
                return refused
        return await self._forward(request, kind)

    async def _forward(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """Pass the request and its answer through, both bodies streamed; a break is a 502 (or a cut body)."""
        target = BASE + request.raw_path  # the request target as the client sent it, query included
        data = request.content.iter_any() if request.body_exists else None
        response: web.StreamResponse | None = None
        try:
            async with self.upstream.session.request(
                request.method, target, headers=_headers(request.headers), data=data, allow_redirects=False
            ) as answer:
                response = web.StreamResponse(
                    status=answer.status, reason=answer.reason, headers=_headers(answer.headers)
                )
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        except BROKEN as exc:
            if kind is Kind.PROBE:
                if response is None:
                    return _error(503, f"the engine does not answer ({type(exc).__name__})", "engine_unavailable")
                raise
            self._engine_broke()
            if response is None:
                self.metrics.finished("failed_restart")
                return _error(502, f"the engine went away ({type(exc).__name__})", "engine_restart")
            raise  # headers went out: cutting the body is the one honest answer left
        if kind is not Kind.PROBE:  # a monitor's polling is not client traffic
            self.metrics.finished(_outcome(request, "forwarded"))
        return response

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        body = await request.content.read(self.cfg.max_body_bytes + 1)
        if len(body) > self.cfg.max_body_bytes or not request.content.at_eof():
            return _error(413, f"the body exceeds front.max_body_bytes ({self.cfg.max_body_bytes})", "too_large")
        return body

    async def _resumable(self, request: web.Request, fmt: str) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        if b'"stream"' not in body:  # the common short request: not parsed here (the engine parses it)
            return await self._retrying(request, body)
        try:
            parsed = parse_json(body, _JSON_DEPTH)
        except Untrusted:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("stream") is True:
            return await self._stream(request, fmt, parsed)
        return await self._retrying(request, body)

    async def _retrying(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """A non-streamed completion: vLLM sends its answer whole at the end, so one broken before it is sent
        again; the answer is read whole (one JSON document) so that a break inside it can be retried too."""
        for attempt in range(self.cfg.max_attempts):
            refused = await self._hold(request)
            if refused is not None:
                return refused
            try:
                async with self.upstream.session.post(
                    BASE + request.raw_path, data=body, headers=_headers(request.headers)
                ) as answer:
                    data = await answer.read()
                    if answer.status >= 500 and await self._engine_down_now():
                        raise EngineBroke
                    self.metrics.finished(_outcome(request, "forwarded" if attempt == 0 else "retried"))
                    return web.Response(status=answer.status, body=data, headers=_headers(answer.headers))
            except (*BROKEN, EngineBroke) as exc:
                self._engine_broke()
                self.log.warning("front.retry", path=request.path, attempt=attempt + 1, why=type(exc).__name__)
        self.metrics.finished("failed_restart")
        return _error(503, f"the engine broke this request {self.cfg.max_attempts} times", "engine_restart")

    async def _stream(self, request: web.Request, fmt: str, body: dict[str, Any]) -> web.StreamResponse:
        record = StreamRecord.of(fmt, body)
        client = _Client(request)
        resumed = False
        for _attempt in range(self.cfg.max_attempts):
            refused = await self._hold(client.request)
            if refused is not None:
                if client.response is None:
                    return refused
                return await self._end(client, record, "the engine did not come back within the hold bound")
            try:
                if client.response is None:
                    record.ids_asked = record.why_not is None and not record.wants_ids
                    sent = upstream_body(body) if record.why_not is None else body
                    reply = await self._relay(client, sent, record)
                    if reply is not None:
                        return reply
                elif record.why_not is not None:
                    return await self._end(client, record, record.why_not)
                else:
                    resumed = True
                    await self._continue(client, body, record)
                self.metrics.finished(_outcome(request, "resumed" if resumed else "forwarded"))
                assert client.response is not None
                await client.response.write_eof()
                return client.response
            except (*BROKEN, EngineBroke) as exc:
                self._engine_broke()
                why = type(exc).__name__
                self.log.warning("front.stream_broken", path=request.path, sent=record.generated, why=why)
            except NotResumable as exc:
                return await self._end(client, record, str(exc))
        if client.response is None:
            self.metrics.finished("failed_restart")
            return _error(503, f"the engine broke this request {self.cfg.max_attempts} times", "engine_restart")
        return await self._end(client, record, f"the engine broke it {self.cfg.max_attempts} times")

    async def _end(self, client: _Client, record: StreamRecord, why: str) -> web.StreamResponse:
        """The stream's last words: one error chunk that says why it cannot go on, then [DONE]."""
        self.metrics.finished("failed_restart")
        self.log.warning("front.stream_failed", path=client.request.path, why=why)
        headers = {"Content-Type": "text/event-stream"}
        await client.write(sse.event(json.dumps(record.error_chunk(why)).encode()), headers)
        await client.write(sse.event(sse.DONE), headers)
        assert client.response is not None
        await client.response.write_eof()
        return client.response

    async def _batches(self, answer: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
        """The answer's SSE data, the events of each read together (the client gets them in one write), up to
        [DONE] (the last of its batch); EngineBroke when the answer ends before it."""
        splitter = sse.EventSplitter()
        async for chunk in answer.content.iter_any():
            batch = []
            for event in splitter.feed(chunk):
                data = sse.data_of(event)
                if data is None:
                    continue
                batch.append(data)
                if data == sse.DONE:
                    yield batch
                    return
            if batch:
                yield batch
        raise EngineBroke

    async def _chunk(self, data: bytes) -> object:
        """One event's JSON; EngineBroke for vLLM's error chunk of a dying engine (EngineDeadError): /health
        fails then, and the stream is resumed rather than ended."""
        chunk = parse_json(data, _JSON_DEPTH)
        if isinstance(chunk, dict) and "error" in chunk and await self._engine_down_now():
            raise EngineBroke
        return chunk

    async def _relay(self, client: _Client, body: dict[str, Any], record: StreamRecord) -> web.Response | None:
        """The first send: the engine's own stream, each chunk kept (record.observe) and passed on.  An answer
        that is not a stream (a 400 for a bad request) is returned as it is."""
        request = client.request
        async with self.upstream.session.post(
            BASE + request.raw_path, json=body, headers=_headers(request.headers)
        ) as answer:
            if answer.status != 200 or not answer.content_type.startswith("text/event-stream"):
                data = await answer.read()
                if answer.status >= 500 and await self._engine_down_now():
                    raise EngineBroke
                self.metrics.finished(_outcome(request, "forwarded"))
                return web.Response(status=answer.status, body=data, headers=_headers(answer.headers))
            headers = _headers(answer.headers)
            # The events that came in one read go out in one write: under load (a slow client, a busy front)
            # several wait in one read, and one write per event was a send(2) and an HTTP chunk each.
            async for batch in self._batches(answer):
                out: list[bytes] = []
                for data in batch:
                    if data == sse.DONE:
                        out += (b"data: ", data, b"\n\n")
                        break
                    if record.why_not is not None and not record.ids_asked and b'"error"' not in data:
                        out += (b"data: ", data, b"\n\n")  # sent as it came: nothing to keep
                        record.events_sent += 1
                        continue
                    raw = record.observe_raw(data) if b'"error"' not in data else None
                    if raw is None:
                        if out:  # kept as sent (record.sent_ids): out before an error chunk can end this send
                            await client.write(b"".join(out), headers)
                            out = []
                        chunk = await self._chunk(data)
                        kept = record.observe(chunk) if isinstance(chunk, dict) else chunk
                        raw = data if kept is chunk else json.dumps(kept).encode()
                    out += (b"data: ", raw, b"\n\n")
                    record.events_sent += 1
                if out:
                    await client.write(b"".join(out), headers)
        return None

    async def _continue(self, client: _Client, body: dict[str, Any], record: StreamRecord) -> None:
        """A resume: the prompt's ids from the render route, then the token-in route from the ids sent."""
        async with self.upstream.session.post(BASE + RENDER_PATHS[record.fmt], json=body) as answer:
            data = await answer.read()
            if answer.status != 200:
                if answer.status >= 500 and await self._engine_down_now():
                    raise EngineBroke
                raise NotResumable(f"the render route answered {answer.status}: {data[:200]!r}")
            continuation = record.generate_body(parse_json(data, _JSON_DEPTH))
        async with self.upstream.session.post(BASE + GENERATE_PATH, json=continuation) as answer:
            if answer.status != 200:
                data = await answer.read()
                if answer.status >= 500 and await self._engine_down_now():
                    raise EngineBroke
                raise NotResumable(f"the token-in route answered {answer.status}: {data[:200]!r}")
            headers = {"Content-Type": "text/event-stream"}
            async for batch in self._batches(answer):
                out: list[bytes] = []
                for data in batch:
                    if data == sse.DONE:
                        out.append(sse.event(data))
                        break
                    if b'"error"' in data and out:  # kept as sent: out before an error chunk can end this send
                        await client.write(b"".join(out), headers)
                        out = []
                    chunk = await self._chunk(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        raise NotResumable(f"the token-in route failed: {data[:200]!r}")
                    if isinstance(chunk, dict):
                        out.append(sse.event(json.dumps(record.translate(chunk)).encode()))
                        record.events_sent += 1
                if out:
                    await client.write(b"".join(out), headers)
