"""What the front takes of a request's body (deployment/front/bodies.py, issue 49): no content coding, the bytes it
keeps of all requests together bounded, a completion's stream decided by its parsed body, no answer held whole past
its bound, and the headers it passes on.  End to end through the front, against the stand-in engine."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading

import pytest

from kimi_supervisor.deployment.front import bodies
from kimi_supervisor.deployment.front.bodies import MAX_VALUES, Parser, is_stream
from tests.deployment.front.fake_engine import generate, prompt_ids, text_of_run
from tests.deployment.front.harness import BOUND_S, run, running, stream_text, until

pytest.importorskip("aiohttp")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"])
def test_a_gzip_body_is_refused_with_415_before_it_is_read_and_never_reaches_the_engine(path: str) -> None:
    """aiohttp decoded a request's Content-Encoding: 32 KiB of gzip became 32 MiB that the front's one loop read and
    parsed (/front/health took 4 s), then forwarded still labelled gzip. vLLM decodes no request body either."""

    async def scenario() -> None:
        async with running() as h:
            plain = json.dumps({"prompt": "a" * (1 << 20), "max_tokens": 2}).encode()
            packed = gzip.compress(plain)
            assert len(packed) < len(plain) // 100  # the premise: a small upload, a big body
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            async with h.client.post(path, data=packed, headers=headers) as answer:
                assert answer.status == 415
                assert answer.headers["Accept-Encoding"] == "identity"
                doc = await answer.json()
            assert doc["error"]["type"] == "unsupported_content_encoding" and "'gzip'" in doc["error"]["message"]
            assert h.engine.seen == []
            assert h.front.metrics.counts["refused_coding"] == 1
            assert h.front.held_bodies.bytes == 0

    run(scenario)


def test_past_max_held_bytes_a_kept_body_gets_503_with_retry_after_and_the_bytes_come_back() -> None:
    """While the engine is down, held requests keep their bodies: 16 held gzip requests grew the front by 512 MiB,
    and queue_max 1024 x 32 MiB is 32 GiB. All kept bodies together are bounded by front.max_held_bytes."""

    async def scenario() -> None:
        async with running(engine_up=False, hold_s=BOUND_S, max_held_bytes=100_000) as h:
            body = {"prompt": "a" * 60_000, "max_tokens": 2}
            size = len(json.dumps(body).encode())
            first = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            await until(lambda: h.front.gate.held == 1, "the first request is held")
            assert h.front.held_bodies.bytes == size
            async with h.client.post("/v1/completions", json=body) as answer:
                assert answer.status == 503
                assert int(answer.headers["Retry-After"]) >= 1
                doc = await answer.json()
            assert doc["error"]["type"] == "front_full" and "front.max_held_bytes" in doc["error"]["message"]
            assert h.front.metrics.counts["rejected_held_bytes"] == 1 and h.front.gate.held == 1
            assert h.front.held_bodies.bytes == size  # the refused one's chunks were given back
            await h.engine.start()
            async with await asyncio.wait_for(first, BOUND_S) as answer:
                assert answer.status == 200
            await until(lambda: h.front.held_bodies.bytes == 0, "the answered request's body is let go")

    run(scenario)


def test_a_stream_spelled_with_an_escape_is_a_stream_and_its_first_chunk_is_not_held_back() -> None:
    """`"\\u0073tream": true` is a stream to vLLM. The front looked for the bytes `"stream"`, sent it down the
    non-streamed path, and read the whole SSE answer into memory before the client saw any of it."""

    async def scenario() -> None:
        async with running() as h:
            h.engine.hold_after_first = asyncio.Event()
            raw = b'{"prompt": "hi", "max_tokens": 4, "\\u0073tream": true}'
            headers = {"Content-Type": "application/json"}
            async with h.client.post("/v1/completions", data=raw, headers=headers) as answer:
                first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), BOUND_S)
                h.engine.hold_after_first.set()
                text, events = await stream_text(answer)
            assert events[-1] == "[DONE]"
            [(_, seen)] = h.engine.seen
            assert seen is not None and seen["return_token_ids"] is True  # the resumable stream's path
            first_text = json.loads(first.decode().removeprefix("data: "))["choices"][0]["text"]
            assert first_text + text == text_of_run(generate(prompt_ids("/v1/completions", {"prompt": "hi"}), 4))

    run(scenario)


def test_a_stream_too_big_to_parse_is_passed_through_as_it_comes_never_held_whole() -> None:
    """A body of more JSON values than MAX_VALUES is not parsed (json's C parser holds the GIL: only their number
    bounds the loop's stall): it goes as it is, not resumable, and its answer, a stream, is passed on as it comes."""

    async def scenario() -> None:
        async with running() as h:
            h.engine.hold_after_first = asyncio.Event()
            raw = b'{"prompt": "hi", "max_tokens": 4, "stream": true, "pad": [' + b"0," * MAX_VALUES + b"0]}"
            headers = {"Content-Type": "application/json"}
            async with h.client.post("/v1/completions", data=raw, headers=headers) as answer:
                first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), BOUND_S)
                assert first.startswith(b"data: ")
                h.engine.hold_after_first.set()
                _, events = await stream_text(answer)
            assert events[-1] == "[DONE]"
            [(_, seen)] = h.engine.seen
            assert seen is not None and "return_token_ids" not in seen  # forwarded as it came

    run(scenario)


def test_a_large_body_is_parsed_off_the_loop_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    where: list[bool] = []
    real = bodies.parse_json

    def parse(raw: bytes, depth: int | None = None) -> object:
        where.append(threading.current_thread() is threading.main_thread())
        return real(raw, depth)

    monkeypatch.setattr(bodies, "parse_json", parse)

    async def scenario() -> None:
        parser = Parser()
        small = json.dumps({"prompt": "a", "stream": True}).encode()
        large = json.dumps({"prompt": "a" * bodies.PARSE_INLINE_BYTES, "stream": 1}).encode()
        assert await parser.parse(small) == {"prompt": "a", "stream": True}
        parsed = await parser.parse(large)
        assert parsed is not None and is_stream(parsed)
        assert await parser.parse(b"[" + b"0," * MAX_VALUES + b"0]") is None  # never handed to the parser

    asyncio.run(scenario())
    assert where == [True, False]


@pytest.mark.parametrize(
    ("value", "stream"),
    [(True, True), (False, False), (1, True), (0, False), ("yes", True), ("off", False), (None, False), ([1], False)],
)
def test_stream_is_read_as_vllms_pydantic_reads_a_bool(value: object, stream: bool) -> None:
    assert is_stream({"stream": value}) is stream


def test_the_engine_gets_the_clients_address_as_x_forwarded_for_and_no_header_its_connection_names() -> None:
    """docs/front.md said X-Forwarded-For is set: a client's own value reached vLLM verbatim. Headers the client's
    `Connection:` names are for its hop only (RFC 9110 7.6.1) and were forwarded."""

    async def scenario() -> None:
        async with running() as h:
            headers = {"X-Forwarded-For": "6.6.6.6", "Connection": "keep-alive, X-Hop", "X-Hop": "1", "X-End": "2"}
            async with h.client.get("/v1/models", headers=headers) as answer:
                assert answer.status == 200
            body = {"prompt": "hi", "max_tokens": 2, "stream": True}
            async with h.client.post("/v1/completions", json=body, headers=headers) as answer:
                await stream_text(answer)
            for seen in h.engine.headers:
                assert seen["X-Forwarded-For"] == "127.0.0.1"
                assert "X-Hop" not in seen and seen["X-End"] == "2"
            assert len(h.engine.headers) == 2

    run(scenario)
