"""How a resumed stream ends (kimi_supervisor/deployment/front/facts.py): with the engine's own system_fingerprint, and
with the engine's usage chunk or, where a resume cannot count what the engine's usage has, an error chunk in its
place; never a chunk that differs from the engine's.  The parsing on vLLM 0.32's answers as its serving writes them
(vllm/entrypoints/openai/chat_completion/serving.py, vllm/entrypoints/openai/completion/serving.py), the rest
through the front against the stand-in engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kimi_supervisor.deployment.front.facts import EngineFacts, FactsUnknown
from tests.deployment.front.harness import BOUND_S, broken, run, running, stream_text, uninterrupted, until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# vLLM 0.32's non-streamed answers to the one-token request (JSONResponse of model_dump(): nulls written), cut to
# the fields facts.py reads.
PLAIN_USAGE = {"prompt_tokens": 9, "total_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": None}


def _answer(usage: dict[str, Any], fingerprint: object = "vllm-0.32.0-0f3e9a1c", metrics: object = None) -> object:
    return {"id": "chatcmpl-1", "object": "chat.completion", "usage": usage, "system_fingerprint": fingerprint} | {
        "metrics": metrics
    }


def test_the_facts_of_an_engine_with_and_without_a_reasoning_parser() -> None:
    plain = EngineFacts.of(_answer(PLAIN_USAGE | {"completion_tokens_details": None}))
    assert plain == EngineFacts("vllm-0.32.0-0f3e9a1c", False, ())
    assert plain.why_no_usage("chat") is None and plain.why_not_continuous("chat") is None
    parsed = EngineFacts.of(_answer(PLAIN_USAGE | {"completion_tokens_details": {"reasoning_tokens": 0}}))
    assert parsed.reasoning_tokens
    assert "reasoning_tokens" in (parsed.why_no_usage("chat") or "")
    assert "reasoning_tokens" in (parsed.why_not_continuous("chat") or "")
    # A completions stream's usage has no reasoning count, whatever the engine's parser.
    assert parsed.why_no_usage("completion") is None and parsed.why_not_continuous("completion") is None


def test_what_a_resume_cannot_count_is_named() -> None:
    cached = EngineFacts.of(_answer(PLAIN_USAGE | {"prompt_tokens_details": {"cached_tokens": 8}}, None))
    assert cached.fingerprint is None and cached.uncounted == ("usage.prompt_tokens_details",)
    assert "usage.prompt_tokens_details" in (cached.why_no_usage("completion") or "")
    timed = EngineFacts.of(_answer(PLAIN_USAGE, metrics={"time_to_first_token_s": 0.1}))
    assert timed.uncounted == ("metrics",) and "metrics" in (timed.why_no_usage("chat") or "")


@pytest.mark.parametrize(
    "answer",
    [[], {"id": "x"}, {"usage": "9"}, _answer(PLAIN_USAGE, fingerprint=7)],
    ids=["not-an-object", "no-usage", "usage-not-an-object", "fingerprint-not-a-string"],
)
def test_an_answer_that_does_not_say_is_refused_by_name(answer: object) -> None:
    with pytest.raises(FactsUnknown, match=r"usage|system_fingerprint"):
        EngineFacts.of(answer)


def _shape(event: Any) -> str:
    """An event with its text left out: a resumed chat stream's text comes in other pieces (one derender call per
    read of the token-in route), everything else is the engine's, key for key, in its order."""
    if not isinstance(event, dict):
        return str(event)
    out = dict(event)
    out["choices"] = [
        c | ({"text": ""} if "text" in c else {}) | ({"delta": dict.fromkeys(c["delta"], "")} if "delta" in c else {})
        for c in event.get("choices", [])
    ]
    return json.dumps(out)


def _text(events: list[Any]) -> str:
    pieces = [c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e.get("choices", [])]
    reasoning = [c.get("delta", {}).get("reasoning") or "" for e in events for c in e.get("choices", [])]
    return "".join(reasoning) + "|" + "".join(pieces)


def _body(path: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 12, "stream": True, **extra}
    return body | ({"messages": [{"role": "user", "content": "tell"}]} if path == CHAT else {"prompt": "tell"})


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fingerprint", ["vllm-0.32.0-tp8-1a2b3c4d", None], ids=["full", "none"])
def test_a_resumed_streams_terminal_chunk_is_the_engines_own(path: str, fingerprint: str | None) -> None:
    """Was: the terminal chunk of every resumed stream lacked the engine's system_fingerprint."""

    async def scenario() -> None:
        body = _body(path)
        async with running(hold_s=BOUND_S) as h:
            h.engine.fingerprint = fingerprint
            h.engine.reasoning, h.engine.counts_reasoning = 3, True  # no usage asked: nothing to count
            _want, plain = await uninterrupted(h, path, body)
            events = await broken(h, path, body)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert _shape(events[-2]) == _shape(plain[-2])
        assert [e.get("system_fingerprint") for e in events[:-1]] == [None] * (len(events) - 2) + [fingerprint]

    run(scenario)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_resumed_streams_usage_chunk_is_the_engines(path: str) -> None:
    async def scenario() -> None:
        body = _body(path, stream_options={"include_usage": True})
        async with running(hold_s=BOUND_S) as h:
            h.engine.reasoning = 3  # a chat stream splits reasoning from content; the engine does not count it
            _want, plain = await uninterrupted(h, path, body)
            events = await broken(h, path, body)
        assert _shape(events[-2]) == _shape(plain[-2]) and plain[-2]["system_fingerprint"]
        assert not any(e.get("system_fingerprint") for e in events[:-2])

    run(scenario)


def test_a_resumed_chat_stream_whose_engine_counts_reasoning_tokens_ends_with_an_error_where_its_usage_was() -> None:
    """Was: its usage chunk went out without completion_tokens_details: a silent difference."""

    async def scenario() -> None:
        body = _body(CHAT, stream_options={"include_usage": True})
        async with running(hold_s=BOUND_S) as h:
            h.engine.reasoning, h.engine.counts_reasoning = 3, True
            _want, plain = await uninterrupted(h, CHAT, body)
            events = await broken(h, CHAT, body)
            counts = dict(h.front.metrics.counts)
        assert plain[-2]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        # Every piece of text the engine would have sent, then the error in place of the usage chunk.
        assert _text(events[:-2]) == _text(plain[:-2]) and "usage" not in events[-3]
        error = events[-2]["error"]["message"]
        assert "went out whole" in error and "completion_tokens_details.reasoning_tokens" in error
        assert events[-1] == "[DONE]" and counts["failed_restart"] == 1 and counts["resumed"] == 0

    run(scenario)


def test_continuous_usage_on_an_engine_that_counts_reasoning_tokens_ends_at_the_break() -> None:
    async def scenario() -> None:
        body = _body(CHAT, stream_options={"include_usage": True, "continuous_usage_stats": True})
        async with running(hold_s=BOUND_S) as h:
            h.engine.reasoning, h.engine.counts_reasoning = 3, True
            events = await broken(h, CHAT, body)
            paths = [p for p, _ in h.engine.seen]
        assert "continuous usage with a reasoning parser" in events[-2]["error"]["message"]
        assert "/inference/v1/generate" not in paths  # nothing generated for a stream that cannot go on

    run(scenario)


def test_continuous_usage_resumed_on_a_plain_chat_engine_is_the_engines_chunk_for_chunk() -> None:
    """Was: the resumed chunks' usage had its keys in another order and no `completion_tokens_details: null`."""

    async def scenario() -> None:
        body = _body(CHAT, stream_options={"include_usage": True, "continuous_usage_stats": True})
        async with running(hold_s=BOUND_S) as h:
            _want, plain = await uninterrupted(h, CHAT, body)
            events = await broken(h, CHAT, body)
        assert [_shape(e) for e in events[-2:]] == [_shape(e) for e in plain[-2:]]
        # Each resumed chunk's usage counts the ids up to its own, as the engine's chunk with that text does.
        counted = {json.dumps(e.get("usage")) for e in plain[:-1]}
        assert {json.dumps(e.get("usage")) for e in events[:-1]} <= counted

    run(scenario)


def test_prompt_tokens_details_end_a_resumed_completion_with_an_error_where_its_usage_was() -> None:
    async def scenario() -> None:
        body = _body(COMPLETIONS, stream_options={"include_usage": True})
        async with running(hold_s=BOUND_S) as h:
            h.engine.prompt_details = True
            events = await broken(h, COMPLETIONS, body)
        assert "usage.prompt_tokens_details" in events[-2]["error"]["message"]

    run(scenario)


def test_an_engine_is_asked_once_while_it_serves_and_again_after_it_restarts() -> None:
    async def scenario() -> None:
        body = _body(COMPLETIONS)
        async with running(hold_s=BOUND_S) as h:
            h.engine.crash_after = 5
            both = [asyncio.ensure_future(h.client.post(COMPLETIONS, json=body)) for _ in range(2)]
            await until(lambda: h.engine.crashes == 1, "the engine crashed under both streams")
            await h.engine.restart()
            for sent in both:
                async with await asyncio.wait_for(sent, BOUND_S) as answer:
                    _text, events = await stream_text(answer)
                    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            again = await broken(h, COMPLETIONS, body)  # the engine's second restart: asked again
            probes = [b for p, b in h.engine.seen if p == COMPLETIONS and b is not None and b.get("max_tokens") == 1]
            counts = dict(h.front.metrics.counts)
        assert again[-1] == "[DONE]" and counts["resumed"] == 3
        assert len(probes) == 2  # one per engine run that resumed streams, however many resumed at once

    run(scenario)
