"""What the front takes of a request's body (docs/front.md, Forwarding): the coding it accepts, the bytes it keeps
of all requests together, and the parse that decides whether a completion is a stream.

Every request is served by the front's one event loop, so nothing a client sends may cost that loop more than the
bytes it sent (issue 49):
  - a body with a `Content-Encoding` is refused (415, `Accept-Encoding: identity`) before one byte of it is read,
    and aiohttp is told never to decode one (`auto_decompress=False`): a 32 KiB gzip body decoded to 32 MiB
    that the loop then parsed, and was forwarded still labelled gzip.  vLLM does not decode request bodies
    either, so no client of it sends one;
  - a body the front keeps (a completion, to be sent again) is counted in `HeldBodies` chunk by chunk as it
    arrives: past `front.max_held_bytes` for all of them together, 503 with Retry-After;
  - a completion's body is parsed in a worker thread, one at a time, unless it is small; one with more JSON
    values than `MAX_VALUES` is not parsed at all but forwarded as it is, not resumable: json's C parser holds
    the GIL, so a thread shortens no parse of millions of values, only their number does.
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web

from kimi_supervisor.deployment.front.context import JSON_DEPTH, error_response
from kimi_supervisor.untrusted_json import Untrusted, parse_json

READ_CHUNK = 64 << 10
PARSE_INLINE_BYTES = 64 << 10  # parsed on the loop below this: microseconds
# The most JSON values (counted by their separators and containers) of a body the front parses: a 256k-token
# prompt as token ids; json.loads of this many is tens of ms on a server core.  More: forwarded unparsed.
MAX_VALUES = 1 << 18
_IDENTITY = ("", "identity")
# pydantic's lax bool (vLLM's request models): what it reads as true for `stream`.
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


class HeldBodies:
    """The bytes of the request bodies the front keeps at once, bounded (loop-only: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0

    def take(self, size: int) -> bool:
        if self.bytes + size > self.limit:
            return False
        self.bytes += size
        return True

    def give(self, size: int) -> None:
        self.bytes -= size


def refused_coding(request: web.Request) -> web.Response | None:
    """The 415 for a body with a content coding; None for a plain one."""
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if coding in _IDENTITY or not request.body_exists:
        return None
    message = f"Content-Encoding {coding[:40]!r} is not accepted: send the body as it is (vLLM does not decode it)"
    response = error_response(415, message, "unsupported_content_encoding")
    response.headers[hdrs.ACCEPT_ENCODING] = "identity"
    response.force_close()  # its body is not read: the connection cannot carry another request
    return response


async def read_kept(
    request: web.Request, limit: int, held: HeldBodies, retry_after_s: int
) -> tuple[bytes, web.Response | None]:
    """The whole body, at most `limit` bytes, counted in `held` as it arrives (the caller gives `len(body)` back
    once it lets the body go); or the 413 or 503 it gets instead, with nothing left counted."""
    if request.content_length is not None and request.content_length > limit:
        return b"", _too_large(limit)
    parts: list[bytes] = []
    taken = 0
    try:
        async for chunk in request.content.iter_chunked(READ_CHUNK):
            if taken + len(chunk) > limit:
                held.give(taken)
                return b"", _too_large(limit)
            if not held.take(len(chunk)):
                held.give(taken)
                message = f"the front keeps {held.limit} bytes of request bodies at most (front.max_held_bytes)"
                return b"", error_response(503, message, "front_full", retry_after_s)
            taken += len(chunk)
            parts.append(chunk)
    except BaseException:
        held.give(taken)
        raise
    return b"".join(parts), None


def _too_large(limit: int) -> web.Response:
    response = error_response(413, f"the body exceeds front.max_body_bytes ({limit})", "too_large")
    response.force_close()
    return response


class Parser:
    """Completion bodies parsed off the loop, one at a time (one front: one Parser)."""

    def __init__(self) -> None:
        self._one = asyncio.Lock()

    async def parse(self, body: bytes) -> dict[str, object] | None:
        """The body's JSON object; None when it is not one, or has more than MAX_VALUES values (not parsed)."""
        if values(body) > MAX_VALUES:
            return None
        try:
            if len(body) < PARSE_INLINE_BYTES:
                parsed = parse_json(body, JSON_DEPTH)
            else:
                async with self._one:
                    parsed = await asyncio.to_thread(parse_json, body, JSON_DEPTH)
        except Untrusted:
            return None
        return parsed if isinstance(parsed, dict) else None


def values(body: bytes) -> int:
    """An upper bound on the JSON values in `body` (separators inside strings count too): C-speed counts."""
    return body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{") + 1


def is_stream(body: dict[str, object]) -> bool:
    """Whether vLLM streams its answer: `stream` as pydantic reads a bool (true, 1, "yes", ...), by the parsed
    body and never its bytes (`"\\u0073tream": true` is a stream to vLLM)."""
    value = body.get("stream")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE_WORDS
