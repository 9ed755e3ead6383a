"""A streamed completion through engine restarts (docs/front.md, Resume): the engine's stream relayed with what a
resume needs kept (resume.py's StreamRecord), and after a break the stream continued on the engine that serves,
through its render route and then the token-in route, under the same id, to one [DONE].

What counts as a break is failure.py's; a stream that cannot go on ends with one error chunk that says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from kimi_supervisor.deployment.front import sse
from kimi_supervisor.deployment.front.context import (
    JSON_DEPTH,
    FrontContext,
    error_response,
    outcome,
    pass_on,
    passed_headers,
    read_answer,
    request_headers,
)
from kimi_supervisor.deployment.front.derender import (
    COMPLETION_DERENDER_PATH,
    DERENDER_PATH,
    DETOKENIZE_PATH,
    MORE_HELD_BACK,
    Derender,
    decoding,
    ends_inside,
    pending,
    settling,
)
from kimi_supervisor.deployment.front.engine import BASE, BROKEN, Engine
from kimi_supervisor.deployment.front.facts import EngineFacts, FactsUnknown, probe_request
from kimi_supervisor.deployment.front.failure import AnswerCut, EngineBroke, Failures
from kimi_supervisor.deployment.front.resume import (
    GENERATE_PATH,
    RENDER_PATHS,
    NotResumable,
    StreamRecord,
    upstream_body,
)
from kimi_supervisor.untrusted_json import parse_json

_EVENT_STREAM = {"Content-Type": "text/event-stream"}


def credentials(request: web.Request) -> dict[str, str]:
    """The client's own credentials for the engine (`--api-key`): the resume's requests are the client's, so they
    carry its Authorization, and nothing else of its headers (they are not the same requests)."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth is not None else {}


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


class Streams:
    def __init__(self, ctx: FrontContext, failures: Failures) -> None:
        self.ctx = ctx
        self.failures = failures
        # One derender call at a time, whatever the number of resumed streams: vLLM replays its parser over every
        # output id at each call, in the API server that serves every other stream (0.8 s of its CPU per call
        # after 16k ids, bench/results/derender.md).  A stream that waits sends all it read meanwhile in its
        # next call, so it keeps the engine's pace and only its chunks come later and larger.
        self._replays = asyncio.Semaphore(1)

    async def stream(self, request: web.Request, fmt: str, body: dict[str, Any]) -> web.StreamResponse:
        """Relay the engine's stream; after each break, hold until an engine serves and continue it there."""
        ctx = self.ctx
        record = StreamRecord.of(fmt, body)
        client = _Client(request)
        resumed = False
        for _attempt in range(ctx.cfg.max_attempts):
            refused = await ctx.hold(client.request)
            if refused is not None:
                if client.response is None:
                    return refused
                return await self._end(client, record, "the engine did not come back within the hold bound")
            engine = ctx.engines.pick()
            try:
                async with self.failures.connection(engine):
                    if client.response is None:
                        record.ids_asked = record.why_not is None and not record.wants_ids
                        sent = upstream_body(body) if record.why_not is None else body
                        reply = await self._relay(engine, client, sent, record)
                        if reply is not None:
                            return reply
                    elif record.why_not is not None:
                        return await self._end(client, record, record.why_not)
                    else:
                        resumed = True
                        await self._continue(engine, client, body, record)
                    ctx.metrics.finished(outcome(request, "resumed" if resumed else "forwarded"))
                    assert client.response is not None
                    await client.response.write_eof()
                    return client.response
            except EngineBroke as exc:
                ctx.log.warning("front.stream_broken", path=request.path, sent=record.generated, why=exc.why)
            except NotResumable as exc:
                return await self._end(client, record, str(exc))
        if client.response is None:
            ctx.metrics.finished("failed_restart")
            return error_response(503, f"the engine broke this request {ctx.cfg.max_attempts} times", "engine_restart")
        return await self._end(client, record, f"the engine broke it {ctx.cfg.max_attempts} times")

    async def _batches(self, engine: Engine, answer: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
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
        raise self.failures.cut_short(engine)

    async def _end(self, client: _Client, record: StreamRecord, why: str) -> web.StreamResponse:
        """The stream's last words: one error chunk that says why it cannot go on, then [DONE]."""
        self.ctx.metrics.finished("failed_restart")
        self.ctx.log.warning("front.stream_failed", path=client.request.path, why=why)
        await client.write(sse.frame([sse.encode(record.error_chunk(why))]), _EVENT_STREAM)
        await client.write(sse.frame([sse.DONE]), _EVENT_STREAM)
        assert client.response is not None
        await client.response.write_eof()
        return client.response

    async def _relay(
        self, engine: Engine, client: _Client, body: dict[str, Any], record: StreamRecord
    ) -> web.StreamResponse | None:
        """The first send: the engine's own stream, each chunk kept (record.observe) and passed on.  An answer
        that is not a stream (a 400 for a bad request) is returned as it is, held up to `max_body_bytes` and
        passed on as it comes past that."""
        request = client.request
        async with engine.session.post(BASE + request.raw_path, json=body, headers=request_headers(request)) as answer:
            if answer.status != 200 or not answer.content_type.startswith("text/event-stream"):
                data, whole = await read_answer(answer, self.ctx.cfg.max_body_bytes)
                if not whole:
                    try:
                        response = await pass_on(request, answer, data)
                    except BROKEN as exc:
                        # Part of it went out: cutting the client's connection is the one honest answer left.
                        self.failures.engines.broke(engine)
                        self.ctx.metrics.finished("failed_restart")
                        raise AnswerCut(type(exc).__name__) from exc
                    self.ctx.metrics.finished(outcome(request, "forwarded"))
                    return response
                await self.failures.answer(engine, answer.status)
                self.ctx.metrics.finished(outcome(request, "forwarded"))
                return web.Response(status=answer.status, body=data, headers=passed_headers(answer.headers))
            headers = passed_headers(answer.headers)
            # The events that came in one read go out in one write: under load (a slow client, a busy front)
            # several wait in one read, and one write per event was a send(2) and an HTTP chunk each.
            with engine.streaming(answer):
                async for batch in self._batches(engine, answer):
                    out = await self._kept(engine, client, headers, batch, record)
                    if out:
                        await client.write(sse.frame(out), headers)
        return None

    async def _kept(
        self, engine: Engine, client: _Client, headers: dict[str, str], batch: list[bytes], record: StreamRecord
    ) -> list[bytes]:
        """One read's events as the client gets them, each kept for a resume; the events before one that must be
        parsed go out first, so that what the record holds as sent was sent if that event ends this send."""
        out: list[bytes] = []
        for data in batch:
            if data == sse.DONE:
                out.append(data)
                break
            if record.why_not is not None and not record.ids_asked and b'"error"' not in data:
                out.append(data)  # sent as it came: nothing to keep
                continue
            raw = record.observe_raw(data) if b'"error"' not in data else None
            if raw is None:
                if out:
                    await client.write(sse.frame(out), headers)
                    out = []
                chunk = await self.failures.chunk(engine, data)
                kept = record.observe(chunk) if isinstance(chunk, dict) else chunk
                raw = data if kept is chunk else sse.encode(kept)
            out.append(raw)
        return out

    async def _continue(self, engine: Engine, client: _Client, body: dict[str, Any], record: StreamRecord) -> None:
        """A resume: the prompt's ids from the render route, then for each unfinished choice (`n` > 1: one after
        the other) the token-in route from its ids sent; then the whole run's usage and [DONE]."""
        facts = await self._facts(engine, client.request, record)
        why = facts.why_not_continuous(record.fmt) if record.continuous_usage else None
        if why is not None:
            raise NotResumable(why)
        record.fingerprint = facts.fingerprint
        rendered = await self._rendered(engine, client.request, body, record)
        for index in record.unfinished:
            await self._continue_choice(engine, client, body, record, rendered, index)
        why = facts.why_no_usage(record.fmt) if record.include_usage else None
        if why is not None:
            raise NotResumable(why)
        usage = [sse.encode(record.usage_chunk())] if record.include_usage else []
        await client.write(sse.frame([*usage, sse.DONE]), _EVENT_STREAM)

    async def _facts(self, engine: Engine, request: web.Request, record: StreamRecord) -> EngineFacts:
        """What this engine ends a stream of this kind with (facts.py): one request per kind while it serves, shared
        by the streams that resume at once; a failed one is asked again by the next resume."""
        known = engine.facts.get(record.fmt)
        if known is None:
            known = engine.facts[record.fmt] = asyncio.ensure_future(self._ask_facts(engine, request, record))
        try:
            return await asyncio.shield(known)
        except Exception:
            if engine.facts.get(record.fmt) is known:
                del engine.facts[record.fmt]
            raise

    async def _ask_facts(self, engine: Engine, request: web.Request, record: StreamRecord) -> EngineFacts:
        path, body = probe_request(record.fmt, record.model, record.prompt_ids)
        answer = await self._ask(engine, path, body, credentials(request), "the engine answered its one-token request")
        try:
            return EngineFacts.of(answer)
        except FactsUnknown as exc:
            raise NotResumable(str(exc)) from exc

    async def _ask(
        self, engine: Engine, path: str, body: dict[str, Any], headers: dict[str, str], refused: str
    ) -> object:
        """One request of a resume that the engine answers whole: its parsed JSON; for any answer but 200,
        NotResumable saying `refused` and the answer (EngineBroke for a 5xx while the engine's /health fails)."""
        async with engine.session.post(BASE + path, json=body, headers=headers) as answer:
            data = await answer.read()
            if answer.status != 200:
                await self.failures.answer(engine, answer.status)
                raise NotResumable(f"{refused} {answer.status}: {data[:200]!r}")
            return parse_json(data, JSON_DEPTH)

    async def _hold_back_to_a_whole_character(
        self, engine: Engine, headers: dict[str, str], record: StreamRecord, index: int
    ) -> None:
        """One more id held back while the engine's /detokenize says the continuation's prompt ends inside a
        character (derender.py, ends_inside); NotResumable when MORE_HELD_BACK did not reach a whole one."""
        kept = record.choice(index)
        for _ in range(MORE_HELD_BACK + 1):
            call = decoding(record, index)
            if call is None:
                return
            answer = await self._ask(engine, DETOKENIZE_PATH, call, headers, "the detokenize route answered")
            if not ends_inside(answer):
                return
            kept.hold_back(len(kept.unshown_ids) + 1)
        raise NotResumable(f"the ids sent end inside a character {MORE_HELD_BACK} ids back and more")

    async def _continue_choice(
        self,
        engine: Engine,
        client: _Client,
        body: dict[str, Any],
        record: StreamRecord,
        rendered: object,
        index: int,
    ) -> None:
        """One choice continued: the token-in route's ids as the client's chunks (a chat stream's through the
        engine's parser, derender.py; a completion's from the last id whose character the client has whole)."""
        headers = credentials(client.request)
        derender = Derender(record, body, index) if record.derendered else None
        if derender is not None:
            derender.seeded(await self._derender(engine, headers, derender.seeding()))
        else:
            record.prompt_of(rendered)
            call = settling(record, body, index)
            if call is not None:
                answer = await self._ask(engine, COMPLETION_DERENDER_PATH, call, headers, "the derender route answered")
                record.choice(index).hold_back(pending(answer))
                await self._hold_back_to_a_whole_character(engine, headers, record, index)
        continuation = record.generate_body(rendered, index)
        async with engine.session.post(BASE + GENERATE_PATH, json=continuation, headers=headers) as answer:
            if answer.status != 200:
                data = await answer.read()
                await self.failures.answer(engine, answer.status)
                raise NotResumable(f"the token-in route answered {answer.status}: {data[:200]!r}")
            with engine.streaming(answer):
                await self._continued(engine, client, headers, record, derender, answer, index)

    async def _continued(
        self,
        engine: Engine,
        client: _Client,
        headers: dict[str, str],
        record: StreamRecord,
        derender: Derender | None,
        answer: aiohttp.ClientResponse,
        index: int,
    ) -> None:
        """The token-in route's answer for one choice, read to its end, as the client's chunks."""
        async for batch in self._batches(engine, answer):
            chunks: list[dict[str, Any]] = []
            for data in batch:
                if data == sse.DONE:
                    break
                chunk = await self.failures.chunk(engine, data)
                if isinstance(chunk, dict) and "error" in chunk:
                    if chunks:  # what came before the error goes out: it can end this send
                        out = await self._chunks(engine, headers, record, derender, chunks, index)
                        await client.write(sse.frame(out), _EVENT_STREAM)
                    raise NotResumable(f"the token-in route failed: {data[:200]!r}")
                if isinstance(chunk, dict) and chunk.get("choices"):
                    chunks.append(chunk)
            out = await self._chunks(engine, headers, record, derender, chunks, index)
            if out:
                await client.write(sse.frame(out), _EVENT_STREAM)

    async def _chunks(
        self,
        engine: Engine,
        headers: dict[str, str],
        record: StreamRecord,
        derender: Derender | None,
        chunks: list[dict[str, Any]],
        index: int,
    ) -> list[bytes]:
        """The client's events for the token-in chunks of one read."""
        if derender is None:
            translated = (record.translate(c, index) for c in chunks)
            return [sse.encode(t) for t in translated if t is not None]
        if not chunks:
            return []
        call, read = derender.calling(chunks)
        answer = await self._derender(engine, headers, call)
        return [sse.encode(derender.chunk(answer, read))]

    async def _derender(self, engine: Engine, headers: dict[str, str], call: dict[str, Any]) -> object:
        async with self._replays:
            return await self._ask(engine, DERENDER_PATH, call, headers, "the derender route answered")

    async def _rendered(
        self, engine: Engine, request: web.Request, body: dict[str, Any], record: StreamRecord
    ) -> object:
        """The render route's answer for the client's body: its prompt's ids and sampling params."""
        path, headers = RENDER_PATHS[record.fmt], credentials(request)
        return await self._ask(engine, path, body, headers, "the render route answered")
