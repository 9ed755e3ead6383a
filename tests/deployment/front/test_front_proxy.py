"""The front's proxy (FrontServer) against a stand-in engine on a Unix socket (docs/front.md), end to end through
its modules: forwarding, streaming, refused routes, client disconnects, holding, retry and stream resume.  Their
seams alone: test_failure.py, test_engine.py, test_records.py, test_resume.py, test_sse.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.deployment.front.facts import probe_request
from kimi_supervisor.opsview.statefile import process_start_time
from tests.deployment.front.fake_engine import cuts, generate, prompt_ids, text_of_run, texts
from tests.deployment.front.harness import BOUND_S, broken, run, running, stream_text, uninterrupted, until

pytest.importorskip("aiohttp")


def test_a_request_and_health_go_through_to_the_engines_socket() -> None:
    async def scenario() -> None:
        async with running() as h:
            async with h.client.get("/health") as answer:
                assert answer.status == 200
            async with h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as answer:
                assert answer.status == 200
                doc = await answer.json()
            want = text_of_run(generate(prompt_ids("/v1/completions", {"prompt": "hi"}), 3))
            assert doc["choices"][0]["text"] == want
            async with h.client.get("/v1/models?x=1") as answer:
                assert (await answer.json()) == {"path": "/v1/models"}
            assert h.front.metrics.counts["forwarded"] == 2

    run(scenario)


def test_a_streams_first_chunk_reaches_the_client_while_the_engine_still_generates() -> None:
    """No buffering: the engine sends its second token only after the client has read the first."""

    async def scenario() -> None:
        async with running() as h:
            h.engine.hold_after_first = asyncio.Event()
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            async with h.client.post("/v1/completions", json=body) as answer:
                first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), BOUND_S)
                assert b'"text": "<' in first or b'"text":"<' in first
                h.engine.hold_after_first.set()
                text, events = await stream_text(answer)
            assert events[-1] == "[DONE]"
            want = generate(prompt_ids("/v1/completions", body), 4)
            first_text = json.loads(first.decode().removeprefix("data: "))["choices"][0]["text"]
            assert first_text + text == text_of_run(want)

    run(scenario)


@pytest.mark.parametrize(
    "path",
    [
        "/pause",
        "/sleep",
        "/scale_elastic_ep",
        "/inference/v1/generate",
        "/v1/chat/completions/render",
        "/v1/load_lora_adapter",
        "/v1/../pause",
    ],
)
def test_control_routes_are_refused_and_never_reach_the_engine(path: str) -> None:
    async def scenario() -> None:
        async with running() as h:
            async with h.client.post(path, json={}) as answer:
                assert answer.status == 403
                doc = await answer.json()
            assert "front.allow_routes" in doc["error"]["message"]
            assert h.engine.seen == []
            assert h.front.metrics.counts["refused_route"] == 1

    run(scenario)


def test_a_control_route_in_allow_routes_is_forwarded() -> None:
    async def scenario() -> None:
        async with running(allow_routes=("/pause",)) as h:
            async with h.client.post("/pause", data=b"") as answer:
                assert answer.status == 200
            assert [p for p, _ in h.engine.seen] == ["/pause"]

    run(scenario)


def test_a_client_that_leaves_mid_stream_aborts_the_engines_request() -> None:
    async def scenario() -> None:
        async with running() as h:
            h.engine.hold_after_first = asyncio.Event()  # never set: the stream waits until its client leaves
            answer = await h.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
            await asyncio.wait_for(answer.content.readuntil(b"\n\n"), BOUND_S)
            answer.close()  # the client goes away
            await asyncio.wait_for(h.engine.aborted.wait(), BOUND_S)

    run(scenario)


def test_a_request_that_arrives_while_the_engine_is_down_waits_and_is_answered() -> None:
    async def scenario() -> None:
        async with running(engine_up=False, hold_s=BOUND_S) as h:
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
            await until(lambda: h.front.gate.held == 1, "the request is held")
            assert not sent.done()
            async with h.client.get("/front/metrics") as answer:
                scraped = await answer.text()
            assert 'kimi_front_held_requests{deployment="kimi-supervisor"} 1.0' in scraped
            assert 'kimi_front_engine_serving{deployment="kimi-supervisor"} 0.0' in scraped
            await h.engine.start()
            answer = await asyncio.wait_for(sent, BOUND_S)
            assert answer.status == 200
            answer.close()
            assert h.front.metrics.hold_seconds._sum.get() > 0
            assert (h.front.metrics.counts["held"], h.front.metrics.counts["forwarded"]) == (1, 0)
            scraped = h.front.metrics.text().decode()
            assert 'kimi_front_held_requests{deployment="kimi-supervisor"} 0.0' in scraped
            assert 'kimi_front_engine_serving{deployment="kimi-supervisor"} 1.0' in scraped

    run(scenario)


def test_while_the_engines_supervisor_stops_it_new_requests_wait_then_eta_gives_retry_after(tmp_path: Path) -> None:
    """A planned restart: the engine still answers /health while its supervisor drains it (state file phase
    `stopping`), and new requests wait for the engine that comes after, not for the one going."""
    state = tmp_path / "state.json"
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "version": "t", "config": "x"}

    def phase(name: str, eta_s: float | None = None) -> None:
        doc = {"schema": 1, "supervisor": me, "phase": name, "loading": {"eta_s": eta_s} if eta_s else None}
        state.write_text(json.dumps(doc))

    async def scenario() -> None:
        phase("ready")
        async with running(hold_s=BOUND_S, engine_state_file=state) as h:
            phase("stopping")
            await until(lambda: not h.front.engines.serving, "the front holds while the engine drains")
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
            await until(lambda: h.front.gate.held == 1, "the request is held, the engine's /health still 200")
            assert h.engine.seen == []
            phase("starting", eta_s=41.2)
            await until(lambda: h.front.engines.eta_s == 41.2, "the front reads the load ETA")
            assert h.front.gate.retry_after_s() == 42
            phase("ready")
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                assert answer.status == 200
            assert [p for p, _ in h.engine.seen] == ["/v1/completions"]

    run(scenario)


def test_a_held_request_gets_503_with_retry_after_once_hold_s_passes() -> None:
    async def scenario() -> None:
        async with running(engine_up=False, hold_s=0.3) as h:
            async with h.client.post("/v1/completions", json={"prompt": "a"}) as answer:
                assert answer.status == 503
                assert answer.headers["Retry-After"] == "1"
                doc = await answer.json()
            assert "did not come back within 0.3s" in doc["error"]["message"]
            assert h.front.metrics.counts["rejected_timeout"] == 1

    run(scenario)


def test_past_queue_max_a_request_gets_503_at_once() -> None:
    async def scenario() -> None:
        async with running(engine_up=False, hold_s=BOUND_S, queue_max=1) as h:
            first = asyncio.ensure_future(h.client.get("/v1/models"))
            await until(lambda: h.front.gate.held == 1, "the first request is held")
            async with h.client.get("/v1/models") as answer:
                assert answer.status == 503
                assert int(answer.headers["Retry-After"]) >= 1
            assert h.front.metrics.counts["rejected_full"] == 1
            await h.engine.start()
            async with await asyncio.wait_for(first, BOUND_S) as answer:
                assert answer.status == 200

    run(scenario)


def test_a_non_streamed_request_broken_by_a_crash_is_sent_again_once_the_engine_is_back() -> None:
    async def scenario() -> None:
        async with running(hold_s=BOUND_S) as h:
            h.engine.crash_before_answer = True
            body = {"prompt": "again", "max_tokens": 3}
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            await until(lambda: h.engine.crashes == 1 and h.front.gate.held == 1, "the crash, then the hold")
            await h.engine.restart()
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                assert answer.status == 200
                doc = await answer.json()
            assert doc["choices"][0]["text"] == text_of_run(generate(prompt_ids("/v1/completions", body), 3))
            assert [p for p, _ in h.engine.seen] == ["/v1/completions", "/v1/completions"]
            assert h.front.metrics.counts["retried"] == 1

    run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("error_chunk", [False, True], ids=["reset", "engine_dead_chunk"])
def test_a_stream_broken_by_a_crash_is_resumed_with_the_uninterrupted_text(path: str, error_chunk: bool) -> None:
    async def scenario() -> None:
        chat = path.startswith("/v1/chat/")
        body: dict[str, Any] = {"max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": "tell"}]} if chat else {"prompt": "tell"}
        async with running(hold_s=BOUND_S) as h:
            want, plain = await uninterrupted(h, path, body)
            h.engine.seen.clear()
            h.engine.crash_after = 5
            h.engine.error_chunk_on_crash = error_chunk
            sent = asyncio.ensure_future(h.client.post(path, json=body))
            await until(lambda: h.engine.crashes == 1, "the engine crashed mid-stream")
            # The engine comes back once the front saw it go (a real one takes minutes): an error chunk is the
            # engine's death only while its /health fails, and a loaded machine can read the chunk late.
            await until(lambda: bool(h.log.events("front.stream_broken")), "the front saw the stream break")
            await h.engine.restart()
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                assert answer.status == 200
                text, events = await stream_text(answer)
        assert text == want
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert not any("error" in e for e in events if isinstance(e, dict))
        assert {e["id"] for e in events if isinstance(e, dict)} == {plain[0]["id"]}
        # The client did not ask for token ids: none reach it, before the crash or after.
        assert not any("token_ids" in c for e in events if isinstance(e, dict) for c in e.get("choices", []))
        assert not any("prompt_token_ids" in e for e in events if isinstance(e, dict))
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        prompt = prompt_ids(path, body)
        assert usage == [{"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12}]
        # The last chunk is the engine's, key for key in its order, its fingerprint included.
        assert json.dumps(events[-2]) == json.dumps(plain[-2]) and events[-2]["system_fingerprint"]
        paths = [p for p, _ in h.engine.seen]
        continuation = dict(h.engine.seen)["/inference/v1/generate"]
        assert continuation is not None
        # Five tokens went out before the crash, the fifth the first half of a character (its text ""): the
        # continuation as text starts after the fourth (the derender route's detokenizer, given the last ids,
        # says the fifth's bytes still wait) and makes the fifth again, never from inside a character; a chat
        # stream's goes on after the fifth, its ids decoded again from the first by the derender route.
        assert [cuts(t) for t in generate(prompt, 5)] == [False, False, False, False, True]
        done = 5 if chat else 4
        assert continuation["token_ids"] == prompt + generate(prompt, done)
        assert continuation["sampling_params"]["max_tokens"] == 12 - done
        # The stream, the one-token request that shows how this engine ends a stream (facts.py), the render route,
        # the derender call (a completion's: then /detokenize, whether the ids it sends end whole), the token-in
        # route.
        asked = [path, path, path + "/render", path + "/derender", *([] if chat else ["/detokenize"])]
        asked.append("/inference/v1/generate")
        assert (
            paths[: len(asked)] == asked
            and h.engine.seen[1][1] == probe_request("chat" if chat else "completion", "tiny", prompt)[1]
        )
        # A chat stream's reads go through the parser; a completion's text is the token-in route's own.
        assert set(paths[len(asked) :]) == ({path + "/derender"} if chat else set())
        assert h.front.metrics.counts["resumed"] == 1
        if chat:
            roles = [c["delta"].get("role") for e in events if isinstance(e, dict) for c in e["choices"]]
            assert [r for r in roles if r] == ["assistant"]

    run(scenario)


def test_a_stream_broken_again_while_it_is_resumed_is_resumed_again_from_where_it_got() -> None:
    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 20, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            want, _ = await uninterrupted(h, "/v1/completions", body)
            h.engine.seen.clear()
            h.engine.crash_after, h.engine.crash_generate_after = 3, 6
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            for crashes in (1, 2):
                await until(lambda n=crashes: h.engine.crashes == n, f"crash {crashes}")
                await h.engine.restart()
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                text, events = await stream_text(answer)
        assert text == want and events.count("[DONE]") == 1
        assert not any("error" in e for e in events if isinstance(e, dict))
        generates = [b for p, b in h.engine.seen if p == "/inference/v1/generate"]
        prompt = prompt_ids("/v1/completions", body)
        assert len(generates) == 2 and generates[0] is not None and generates[1] is not None
        # The second continuation starts after what the first one showed: 3 tokens, then 6 more.
        assert len(generates[1]["token_ids"]) - len(prompt) >= 3 + 6 - 1
        assert generates[1]["token_ids"] == prompt + generate(prompt, len(generates[1]["token_ids"]) - len(prompt))
        assert h.front.metrics.counts["resumed"] == 1

    run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_broken_after_a_chunk_whose_text_ends_inside_a_character_resumes_without_repeating_it(
    path: str,
) -> None:
    """Under load vLLM puts several tokens in one chunk: one can show text and still end with the first half of a
    character.  Was: a completion went on after all its ids, and the token-in route's detokenizer, seeded with ids
    that end inside a character, sent the whole decoded prompt as its first text."""

    async def scenario() -> None:
        body: dict[str, Any] = {"max_tokens": 12, "stream": True}
        if path.startswith("/v1/chat/"):
            body["messages"] = [{"role": "user", "content": "tell"}]
        else:
            body["prompt"] = "tell"
        async with running(hold_s=BOUND_S) as h:
            h.engine.ids_per_chunk = 5
            want, _ = await uninterrupted(h, path, body)
            prompt = prompt_ids(path, body)
            # The first chunk: four tokens of text and the first half of a character.
            assert [cuts(t) for t in generate(prompt, 5)] == [False, False, False, False, True]
            h.engine.seen.clear()
            h.engine.crash_after = 5
            sent = asyncio.ensure_future(h.client.post(path, json=body))
            await until(lambda: h.engine.crashes == 1, "the crash")
            await h.engine.restart()
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                text, events = await stream_text(answer)
        assert text == want and "PROMPT" not in text
        assert not any("error" in e for e in events if isinstance(e, dict))
        assert h.front.metrics.counts["resumed"] == 1
        continuation = dict(h.engine.seen)["/inference/v1/generate"]
        assert continuation is not None
        done = 5 if path.startswith("/v1/chat/") else 4  # a completion's fifth id is generated again
        assert continuation["token_ids"] == prompt + generate(prompt, done)

    run(scenario)


def test_a_completion_resumes_whole_where_the_derender_routes_count_of_waiting_ids_falls_short() -> None:
    """The derender route's detokenizer said no id waits where one did (vLLM 0.32, a byte-level tokenizer: the
    engine's DecodeStream and the route's detokenize_incrementally disagree).  Was: the continuation began inside
    the character and its first text was the whole decoded prompt (the pair runs of issue 52).  Now the engine's
    /detokenize says the ids would end inside a character, and that id is generated again."""

    async def scenario() -> None:
        body: dict[str, Any] = {"prompt": "tell", "max_tokens": 12, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.ids_per_chunk = 5
            h.engine.derender_undercounts = True
            want, _ = await uninterrupted(h, "/v1/completions", body)
            prompt = prompt_ids("/v1/completions", body)
            assert [cuts(t) for t in generate(prompt, 5)] == [False, False, False, False, True]
            h.engine.seen.clear()
            events = await broken(h, "/v1/completions", body)  # after its fifth id
        text = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
        assert text == want and "PROMPT" not in text
        assert not any("error" in e for e in events if isinstance(e, dict))
        asked = [b for path, b in h.engine.seen if path == "/detokenize"]
        assert [b["tokens"][-1] for b in asked] == [generate(prompt, 5)[-1], generate(prompt, 4)[-1]]
        continuation = dict(h.engine.seen)["/inference/v1/generate"]
        assert continuation is not None and continuation["token_ids"] == prompt + generate(prompt, 4)

    run(scenario)


def test_ids_generated_again_reach_the_client_once_with_their_logprobs_however_the_continuation_groups_them() -> None:
    """The last id before the break is the first half of a character: generated again, in one chunk with the ids
    after it.  Was: that chunk's ids and logprobs went out whole, the first one's a second time."""

    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True, "logprobs": 1, "return_token_ids": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.ids_per_chunk = 5
            _want, plain = await uninterrupted(h, "/v1/completions", body)
            events = await broken(h, "/v1/completions", body)

        def joined(evs: list[Any], key: str) -> list[Any]:
            out: list[Any] = []
            for e in evs:
                for c in e.get("choices", []) if isinstance(e, dict) else []:
                    if key == "token_ids":
                        out += c.get("token_ids") or []
                    else:
                        out += (c.get("logprobs") or {}).get(key) or []
            return out

        for key in ("token_ids", "tokens", "token_logprobs", "text_offset"):
            assert joined(events, key) == joined(plain, key), key
        text = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
        assert text == "".join(c["text"] for e in plain if isinstance(e, dict) for c in e.get("choices", []))
        assert not any("error" in e for e in events if isinstance(e, dict))

    run(scenario)


def test_an_engine_without_scale_out_ends_a_broken_stream_with_an_error_chunk_naming_the_403() -> None:
    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.scale_out = False
            h.engine.crash_after = 3
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            await until(lambda: h.engine.crashes == 1, "the engine crashed mid-stream")
            await h.engine.restart()
            h.engine.scale_out = False  # the same flags after its restart
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                _text, events = await stream_text(answer)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "engine_restart" and "the render route answered 403" in error["message"]
        assert "--enable-scale-out" in error["message"]
        assert h.front.metrics.counts["failed_restart"] == 1

    run(scenario)


def test_a_stream_that_cannot_be_resumed_ends_with_an_error_chunk_that_says_why() -> None:
    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True, "echo": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.crash_after = 3
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            await until(lambda: h.engine.crashes == 1, "the engine crashed mid-stream")
            await h.engine.restart()
            async with await asyncio.wait_for(sent, BOUND_S) as answer:
                text, events = await stream_text(answer)
            want = generate(prompt_ids("/v1/completions", body), 12)
            assert text == "".join(texts(want)[0][:3])
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert error["type"] == "engine_restart" and "echo" in error["message"]
            assert h.front.metrics.counts["failed_restart"] == 1
            assert "/inference/v1/generate" not in [p for p, _ in h.engine.seen]

    run(scenario)


async def _http_chunks(port: int, path: str, body: dict[str, Any]) -> list[bytes]:
    """POST over a raw connection; the response body's HTTP/1.1 chunks as they were framed (one per write)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n" + data)
    try:
        status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
        assert status.startswith(b"HTTP/1.1 200") and b"chunked" in status.lower(), status
        chunks = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), BOUND_S)).strip(), 16)
            if size == 0:
                return chunks
            chunks.append(await asyncio.wait_for(reader.readexactly(size + 2), BOUND_S))
    finally:
        writer.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_events_that_arrive_together_reach_the_client_in_one_write(path: str) -> None:
    """An engine's events read at once (it wrote them together, or the front fell behind) go out in one write:
    one HTTP chunk, one send(2), not one per token; the text is the uninterrupted run's."""

    async def scenario() -> None:
        async with running() as h:
            h.engine.burst = True
            body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
            chunks = await _http_chunks(h.port, path, body)
        events = [e for c in chunks for e in c.split(b"\n\n") if e.startswith(b"data: ")]
        first = 1 if path == "/v1/chat/completions" else 0  # the chat role chunk, written before the burst
        assert len(events) == first + 8 + 1 and events[-1] == b"data: [DONE]"
        # The burst (8 tokens and [DONE]) in the last chunk; the role chunk, read with it or before it, too or not.
        assert chunks[-1].count(b"data: ") >= 8 + 1 and len(chunks) <= first + 1, [c[:40] for c in chunks]
        text = "".join(
            (c.get("text") or (c.get("delta") or {}).get("content") or "")
            for e in events[:-1]
            for c in json.loads(e[6:])["choices"]
        )
        assert text == text_of_run(generate(prompt_ids(path, body), 8))

    run(scenario)


def test_a_chat_stream_broken_mid_reasoning_resumes_its_reasoning_through_the_engines_parser() -> None:
    """Was: the continuation's text went out as `content`, the reasoning cut at the break and sent again."""

    async def scenario() -> None:
        body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 12, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.reasoning = 8
            _want, plain = await uninterrupted(h, "/v1/chat/completions", body)
            events = await broken(h, "/v1/chat/completions", body)

        def split(evs: list[Any]) -> tuple[str, str]:
            deltas = [c["delta"] for e in evs if isinstance(e, dict) for c in e.get("choices", [])]
            return "".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas)

        assert split(events) == split(plain) and all(split(plain))
        assert not any("error" in e for e in events if isinstance(e, dict)) and events.count("[DONE]") == 1
        seeding = next(b for p, b in h.engine.seen if p == "/v1/chat/completions/derender")
        assert seeding is not None and seeding["stream_state"] is None
        assert len(seeding["generate_chunk"]["choices"][0]["token_ids"]) == 5

    run(scenario)


def test_the_resumes_requests_carry_the_clients_authorization_and_no_other_header() -> None:
    """Was: an engine with --api-key answered the render route 401 and every resume failed."""

    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True}
        headers = {"Authorization": "Bearer sesame", "X-Client-Only": "1"}
        async with running(hold_s=BOUND_S) as h:
            h.engine.api_key = "sesame"
            async with h.client.post("/v1/completions", json=body, headers=headers) as answer:
                want, _ = await stream_text(answer)
            seen: list[Any] = []
            original = h.engine._generate

            async def spy(request: Any) -> Any:
                seen.append(dict(request.headers))
                return await original(request)

            h.engine._generate = spy  # type: ignore[method-assign]
            events = await broken(h, "/v1/completions", body, headers)
        text = "".join(c.get("text") or "" for e in events if isinstance(e, dict) for c in e.get("choices", []))
        assert text == want and not any("error" in e for e in events if isinstance(e, dict))
        assert not any(p.endswith(" 401") for p, _ in h.engine.seen)
        assert seen and seen[0].get("Authorization") == "Bearer sesame" and "X-Client-Only" not in seen[0]

    run(scenario)


def test_continuous_usage_stats_keep_their_usage_on_every_resumed_chunk() -> None:
    """Was: the resumed chunks came without the usage so far."""

    async def scenario() -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"prompt": "tell", "max_tokens": 12, "stream": True, "stream_options": options}
        async with running(hold_s=BOUND_S) as h:
            _want, plain = await uninterrupted(h, "/v1/completions", body)
            events = await broken(h, "/v1/completions", body)
        usage = [(e["usage"], e["choices"][0]["text"] if e["choices"] else None) for e in events if isinstance(e, dict)]
        assert usage == [(e["usage"], e["choices"][0]["text"] if e["choices"] else None) for e in plain[:-1]]

    run(scenario)


def test_penalties_on_the_output_end_a_broken_stream_with_an_error_chunk_even_as_the_engines_default() -> None:
    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.render_params = {"frequency_penalty": 0.5}  # from the model's generation config
            events = await broken(h, "/v1/completions", body)
        assert events[-1] == "[DONE]" and "frequency penalty" in events[-2]["error"]["message"]
        assert "/inference/v1/generate" not in [p for p, _ in h.engine.seen]

    run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_broken_stream_with_logprobs_resumes_them_in_the_clients_shape(path: str) -> None:
    """Was: logprobs ended the stream with an error chunk (and completions' `logprobs: 0` resumed with null)."""

    async def scenario() -> None:
        chat = path.startswith("/v1/chat/")
        body: dict[str, Any] = {"max_tokens": 12, "stream": True}
        body |= {"messages": [{"role": "user", "content": "tell"}], "logprobs": True} if chat else {"prompt": "tell"}
        body |= {} if chat else {"logprobs": 0}
        async with running(hold_s=BOUND_S) as h:
            _want, plain = await uninterrupted(h, path, body)
            events = await broken(h, path, body)

        def logprobs(evs: list[Any]) -> list[Any]:
            """Each token's entry, in order (a resumed chat chunk may carry the tokens of one read together)."""
            out: list[Any] = []
            for c in (c for e in evs if isinstance(e, dict) for c in e.get("choices", []) if c.get("logprobs")):
                lp = c["logprobs"]
                out += lp["content"] if chat else [[lp[k][n] for k in sorted(lp)] for n in range(len(lp["tokens"]))]
            return out

        got = logprobs(events)
        assert got == logprobs(plain) and len(got) == 12
        assert not any("error" in e for e in events if isinstance(e, dict))

    run(scenario)


def test_resumed_chat_streams_make_one_derender_call_at_a_time() -> None:
    """vLLM replays its parser over every output id at each derender call, in the API server every other stream
    needs: the front's resumed streams never make two at once (each sends what it read meanwhile next time)."""

    async def scenario() -> None:
        body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 40, "stream": True}
        async with running(hold_s=BOUND_S) as h:
            h.engine.reasoning = 8
            h.engine.hold_after_first = asyncio.Event()  # both streams started, then on together
            sent = [asyncio.ensure_future(h.client.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await until(lambda: len(h.engine.seen) == 2, "both streams started")
            h.engine.crash_after = 5  # in one stream: the crash resets both
            h.engine.hold_after_first.set()
            await until(lambda: h.engine.crashes == 1, "the engine crashed mid-stream")
            await h.engine.restart()
            answers = [await asyncio.wait_for(s, BOUND_S) for s in sent]
            events, other = [(await stream_text(a))[1] for a in answers]
        for evs in (events, other):
            assert not any("error" in e for e in evs if isinstance(e, dict)), evs
        assert h.engine.crashes == 1 and h.front.metrics.counts["resumed"] == 2, h.front.metrics.counts
        assert h.engine.most_derendering == 1

    run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_broken_stream_with_n_choices_resumes_each_by_its_index(path: str) -> None:
    """Was: `n` > 1 ended the stream with an error chunk (the front kept one sequence's ids)."""

    async def scenario() -> None:
        chat = path.startswith("/v1/chat/")
        body: dict[str, Any] = {"max_tokens": 12, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": "tell"}]} if chat else {"prompt": "tell"}
        async with running(hold_s=BOUND_S) as h:
            _want, plain = await uninterrupted(h, path, body)
            events = await broken(h, path, body)

        def texts_by_index(evs: list[Any]) -> dict[int, str]:
            out: dict[int, str] = {}
            for c in (c for e in evs if isinstance(e, dict) for c in e.get("choices", [])):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                out[c["index"]] = out.get(c["index"], "") + piece
            return out

        got = texts_by_index(events)
        assert got == texts_by_index(plain) and set(got) == {0, 1} and got[0]
        assert not any("error" in e for e in events if isinstance(e, dict)) and events.count("[DONE]") == 1
        finishes = [(c["index"], c["finish_reason"]) for e in events if isinstance(e, dict) for c in e["choices"]]
        assert sorted(f for f in finishes if f[1]) == [(0, "length"), (1, "length")]
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage == [e["usage"] for e in plain if isinstance(e, dict) and e.get("usage")]
        generates = [b for p, b in h.engine.seen if p == "/inference/v1/generate"]
        assert len(generates) == 2 and all(g is not None and g["sampling_params"]["n"] == 1 for g in generates)

    run(scenario)


def test_a_streams_error_answer_past_max_body_bytes_is_passed_on_as_it_comes_not_held_whole() -> None:
    """Was: the answer to a stream request that was not a stream (a 400) was read whole before the client got a
    byte, however long (issue 49's trust round: the front holds at most max_body_bytes of an answer)."""

    async def scenario() -> None:
        head_part, rest = b'{"error": {"message": "' + b"x" * 4096, b'", "code": 400}}'
        go_on = asyncio.Event()
        async with running(hold_s=BOUND_S, max_body_bytes=1024) as h:
            h.engine.long_error = (head_part, rest, go_on)
            body = {"prompt": "tell", "max_tokens": 12, "stream": True}
            try:
                sent = h.client.post("/v1/completions", json=body)
                async with await asyncio.wait_for(sent, BOUND_S) as answer:  # its status and first bytes
                    assert answer.status == 400
                    got = b""
                    while len(got) < len(head_part):  # the engine holds the rest until the client has this part
                        got += await asyncio.wait_for(answer.content.readany(), BOUND_S)
                    go_on.set()
                    got += await answer.content.read()
            finally:
                go_on.set()  # a front that held the answer whole gave the client nothing: let the engine end it
            assert got == head_part + rest
            assert h.front.metrics.counts["forwarded"] == 1

    run(scenario)
