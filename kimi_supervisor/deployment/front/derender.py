"""A broken chat stream continued through the engine's own parser (docs/front.md, Resume): vLLM 0.32's streaming
derender route turns the token-in route's ids into the chat chunks its reasoning and tool parsers make
(`reasoning`, `content`, `tool_calls`), given the state its client carries (`DerenderStreamState`,
vllm/entrypoints/scale_out/token_in_token_out/protocol.py).  One definition of how Kimi's output is split: vLLM's,
with the engine's own flags; an engine without a parser decodes plain content the same way.

Pure data and functions: streams.py makes the calls.  The state is built by one call that derenders every id the
client has (its answer thrown away: it only seeds the state, vLLM's detokenizer window included), then given the
original stream's chunk boundaries, tool call ids and role, which the parser replays from.

A completion's text stays the token-in route's (the engine's own detokenizer, as before the break); the completion
derender route's detokenizer only says, before it resumes, how many of the last ids the client has are bytes of a
character not yet shown (settling): those are generated again, so the continuation never starts inside one.  That
detokenizer (`detokenize_incrementally`) and the one that made the client's text (a fast tokenizer's DecodeStream)
do not always agree (a byte-level id that ends with a character's first byte): the engine's /detokenize then says
whether the ids the continuation would send end inside a character (ends_inside), and one more is held back while
they do.
"""

from __future__ import annotations

from typing import Any

from kimi_supervisor.deployment.front.resume import NotResumable, StreamRecord, upstream_body

DERENDER_PATH = "/v1/chat/completions/derender"
COMPLETION_DERENDER_PATH = "/v1/completions/derender"
DETOKENIZE_PATH = "/detokenize"
# The last ids of the continuation's prompt that /detokenize decodes: whether the text ends inside a character is
# decided by its last 4 bytes at most, and each id is at least one byte.
_DECODE_TAIL_IDS = 32
# Ids held back after the route's count, at most: a character is at most 4 bytes, so 4 more ids end before it.
MORE_HELD_BACK = 4
# The ids a settling call decodes, the ones before them seeding the detokenizer as its prompt: a character is at
# most 4 bytes and each id at least one, so which of the last ids still wait is decided within the last 8.
_TAIL_IDS = 8
_DECODING = ("skip_special_tokens", "spaces_between_special_tokens")


class Read:
    """The token-in chunks of one read, as one: their ids, logprobs (the client's shape: the route decodes them in
    text mode) and the last one's finish."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: object = None

    def add(self, choice: dict[str, Any]) -> None:
        self.ids += [int(i) for i in choice.get("token_ids") or []]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs = [*(self.logprobs or []), *logprobs["content"]]
        self.finish_reason = choice.get("finish_reason")
        self.stop_reason = choice.get("stop_reason")


class Derender:
    """One chat stream's continuation: the derender requests, and their answers as the client's chunks."""

    def __init__(self, record: StreamRecord, body: dict[str, Any], index: int) -> None:
        self.record = record
        self.index = index
        self.kept = record.choice(index)
        self.chat_request = upstream_body(body)  # as the engine parsed it the first time: with the ids asked
        self.state: dict[str, Any] | None = None

    def seeding(self) -> dict[str, Any]:
        """The first call: every id the client has, as one chunk; only the state of its answer is kept."""
        ids = self.kept.sent_ids + self.kept.unshown_ids
        return self._call({"request_id": "resume", "choices": [{"index": 0, "token_ids": ids}]})

    def seeded(self, answer: object) -> None:
        """The state after the seeding call, with what the parser replays as the original stream had it."""
        state = _state_of(answer)
        kept = self.kept
        if state.get("output_token_ids"):  # a parser is configured: it replays the ids chunk by chunk
            state["output_chunk_lens"] = list(kept.chunk_lens)
        state["tools_streamed"] = kept.tools_streamed
        state["last_tool_call_ids"] = [kept.tool_ids[i] for i in range(len(kept.tool_ids)) if i in kept.tool_ids]
        state["role_sent"] = True
        self.state = state

    def calling(self, generated: list[dict[str, Any]]) -> tuple[dict[str, Any], Read]:
        """One call for the token-in chunks of one read (one parse, however many chunks wait: the cost of a
        replay is per call), and what the client's chunk takes from them."""
        read = Read()
        for chunk in generated:
            for choice in chunk.get("choices") or []:
                if isinstance(choice, dict):
                    read.add(choice)
        merged = {"index": 0, "token_ids": read.ids, "finish_reason": read.finish_reason}
        merged["stop_reason"] = read.stop_reason
        return self._call({"request_id": "resume", "choices": [merged]}), read

    def chunk(self, answer: object, read: Read) -> dict[str, Any]:
        """The client's chunk for one derender answer, under the original id; kept like the engine's own."""
        self.state = _state_of(answer)
        assert isinstance(answer, dict)
        derendered = answer.get("chunk")
        choices = (derendered.get("choices") if isinstance(derendered, dict) else None) or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        record = self.record
        logprobs = {"content": read.logprobs} if read.logprobs is not None else None
        item: dict[str, Any] = {"index": self.index, "delta": _set(choice.get("delta") or {}), "logprobs": logprobs}
        finish = read.finish_reason
        # vLLM's chat serving says `tool_calls` for a run that stopped after a tool call, not for one cut by length.
        item["finish_reason"] = choice.get("finish_reason") if finish == "stop" else finish
        if finish is not None:
            item["stop_reason"] = read.stop_reason
        item["token_ids"] = read.ids
        out = record.observe(record.head() | {"choices": [item]})
        return record.ended(out, self.kept, finish is not None)

    def _call(self, generate_chunk: dict[str, Any]) -> dict[str, Any]:
        prompt = self.record.prompt_ids or []
        return {
            "stream": True,
            "generate_chunk": generate_chunk,
            "stream_state": self.state,
            "prompt_tokens": len(prompt),
            "prompt_token_ids": prompt,
            "chat_request": self.chat_request,
        }


def _state_of(answer: object) -> dict[str, Any]:
    state = answer.get("stream_state") if isinstance(answer, dict) else None
    if not isinstance(state, dict):
        raise NotResumable("the derender route answered without stream_state")
    return dict(state)


def _set(value: Any) -> Any:
    """A pydantic dump as vLLM's serving writes it (`exclude_unset`): without the fields that are None or empty."""
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None and v != []}
    if isinstance(value, list):
        return [_set(v) for v in value]
    return value


def settling(record: StreamRecord, body: dict[str, Any], index: int) -> dict[str, Any] | None:
    """The completion derender call that decodes the last ids the client has of choice `index` (None: it has
    none); pending() reads its answer.  Of the client's request the route reads only the decoding flags
    (vllm/renderers/online_derenderer.py `_decode_params`); one id stands in for the prompt it requires."""
    kept = record.choice(index)
    ids = kept.sent_ids + kept.unshown_ids
    if not ids:
        return None
    tail = ids[-_TAIL_IDS:]
    flags = {k: body[k] for k in _DECODING if k in body}
    return {
        "stream": True,
        "generate_chunk": {"request_id": "resume", "choices": [{"index": 0, "token_ids": tail}]},
        "prompt_token_ids": (record.prompt_ids or []) + ids[: len(ids) - len(tail)],
        "completion_request": {"prompt": [0], **flags},
    }


def decoding(record: StreamRecord, index: int) -> dict[str, Any] | None:
    """The /detokenize call that decodes the end of what choice `index`'s continuation would send as its prompt
    (None: none of its ids would be sent); ends_inside() reads its answer."""
    kept = record.choice(index)
    if not kept.sent_ids:
        return None  # the client's own prompt: its uninterrupted run was primed with the same ids
    return {"model": record.model, "tokens": ((record.prompt_ids or []) + kept.sent_ids)[-_DECODE_TAIL_IDS:]}


def ends_inside(answer: object) -> bool:
    """Whether /detokenize's text ends inside a character (U+FFFD): vLLM 0.32 primes the continuation's
    DecodeStream with the whole prompt and keeps no prefix when its decode ends so, and its first text would then be
    the whole decoded prompt (vllm/v1/engine/detokenizer.py, FastIncrementalDetokenizer)."""
    text = answer.get("prompt") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        raise NotResumable(f"the detokenize route answered without its text: {str(answer)[:200]}")
    return text.endswith("\ufffd")


def pending(answer: object) -> int:
    """How many of the decoded ids still wait for the rest of their character: the detokenizer's window holds them
    after its read offset (vllm/tokenizers/detokenizer_utils.py `detokenize_incrementally`)."""
    state = _state_of(answer)
    window, read = state.get("prev_tokens"), state.get("read_offset")
    if not isinstance(window, list) or not isinstance(read, int) or not 0 <= read <= len(window):
        raise NotResumable(f"the derender route answered a stream_state without its window: {str(state)[:200]}")
    return len(window) - read
