"""What every request handler of the front shares (docs/front.md): its config, log, metrics, engines and gate, and
the answers they give alike: the OpenAI-style error, the headers passed on, the bounded hold, and what a finished
request counts as."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import aiohttp
from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.engine import EnginePool
from kimi_supervisor.deployment.front.gate import EngineGate, QueueFull
from kimi_supervisor.deployment.front.metrics import FrontMetrics
from kimi_supervisor.logs.types import Logger

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
JSON_DEPTH = 64  # the deepest request body or chunk the front parses
_HELD = web.RequestKey("kimi_front.held", bool)  # this request waited for the engine (metrics: outcome "held")


def outcome(request: web.Request, outcome: str) -> str:
    """What a request answered at last counts as: "held" for one that waited and then went through at once."""
    return "held" if outcome == "forwarded" and request.get(_HELD) else outcome


def passed_headers(headers: Any) -> dict[str, str]:
    """The end-to-end headers, passed on as they are: not the hop-by-hop ones, nor any the message's own
    `Connection:` names (RFC 9110 7.6.1: they were for this hop only)."""
    named = {n.strip().lower() for v in headers.getall("Connection", ()) for n in v.split(",")}
    return {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() not in named}


def request_headers(request: web.Request) -> dict[str, str]:
    """What the engine gets of a client's headers: the end-to-end ones, and X-Forwarded-For set to the client's
    address: the front is the edge, so a client's own X-Forwarded-For is a claim, never passed on."""
    headers = {k: v for k, v in passed_headers(request.headers).items() if k.lower() != "x-forwarded-for"}
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    return headers


def error_response(status: int, message: str, error_type: str, retry_after: int | None = None) -> web.Response:
    """An OpenAI-style error body (`error_type` is its `type`), as vLLM's own errors are."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": error_type, "code": status}}
    return web.json_response(body, status=status, headers=headers)


async def read_answer(answer: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """An engine's answer read up to `limit` bytes, and whether that is all of it.  Not all: one the front must not
    hold whole, a stream or an answer past the bound (`pass_on` sends the rest as it comes)."""
    if answer.content_type == "text/event-stream":
        return b"", False
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


async def pass_on(request: web.Request, answer: aiohttp.ClientResponse, head: bytes) -> web.StreamResponse:
    """The answer to the client as it comes after `head` (what `read_answer` read), never held whole."""
    response = web.StreamResponse(status=answer.status, reason=answer.reason, headers=passed_headers(answer.headers))
    await response.prepare(request)
    if head:
        await response.write(head)
    async for chunk in answer.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


@dataclasses.dataclass
class FrontContext:
    cfg: FrontConfig
    log: Logger
    metrics: FrontMetrics
    engines: EnginePool
    gate: EngineGate

    async def hold(self, request: web.Request) -> web.Response | None:
        """None once an engine serves; else the 503 the request gets (queue full, or hold_s passed).  A request
        that waited is marked, so that it is counted `held` when it is answered (`outcome`)."""
        if self.engines.serving:
            return None
        request[_HELD] = True
        gate = self.gate
        began = time.monotonic()
        try:
            served = await gate.wait()
        except QueueFull:
            self.metrics.finished("rejected_full")
            message = f"the engine is restarting and {gate.queue_max} requests wait already"
            return error_response(503, message, "engine_restart", gate.retry_after_s())
        self.metrics.waited(time.monotonic() - began)
        if served:
            return None
        self.metrics.finished("rejected_timeout")
        message = f"the engine did not come back within {gate.hold_s:g}s"
        return error_response(503, message, "engine_restart", gate.retry_after_s())
