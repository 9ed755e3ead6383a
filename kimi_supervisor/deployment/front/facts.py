"""What an engine writes at a stream's end beyond its tokens (docs/front.md, Resume), learned from the engine itself.

vLLM 0.32 ends a stream with its `system_fingerprint` (`vllm-<version>[-tpN]-<hash8 of its config>`,
`--fingerprint-mode`; on the terminal chunk, or on the usage chunk when the client asked for usage) and, in the usage
chunk, details that come from the stream it generated: `completion_tokens_details.reasoning_tokens` (its reasoning
parser's count), `prompt_tokens_details` (`--enable-prompt-tokens-details`: the prefix cache's hits) and `metrics`
(`--enable-per-request-metrics`, speculative decoding: timings).  A resumed stream is written by the front from the
token-in and derender routes, which give none of them.  So the front asks the engine that continues a stream once,
with a one-token request of the stream's kind, and keeps its answer for as long as that engine serves: the
fingerprint is the engine's own, and a usage detail that a resume cannot count makes the resumed stream end with
an error chunk where its usage would be, never a usage chunk that differs from the engine's.

Pure data and functions: streams.py sends the request (probe_request) and caches the parsed answer on the Engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The cheapest request of each kind that the engine answers with everything it adds at a stream's end: one
# generated token, no stream.  A chat request through the chat route (the reasoning parser is the chat route's).
PROBE_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def probe_request(fmt: str, model: str, prompt_ids: list[int] | None) -> tuple[str, dict[str, Any]]:
    """The path and body of the one-token request that shows what this engine ends a `fmt` stream with."""
    if fmt == "chat":
        return PROBE_PATHS[fmt], {"model": model, "messages": [{"role": "user", "content": "."}], "max_tokens": 1}
    return PROBE_PATHS[fmt], {"model": model, "prompt": (prompt_ids or [0])[:1], "max_tokens": 1}


class FactsUnknown(Exception):
    """The engine's answer to the probe does not say what it ends a stream with."""


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    fingerprint: str | None  # None: the engine writes none (`--fingerprint-mode none`)
    reasoning_tokens: bool  # its usage carries completion_tokens_details (a reasoning parser is configured)
    uncounted: tuple[str, ...]  # what else its usage chunk carries that a resume cannot know

    @classmethod
    def of(cls, answer: object) -> EngineFacts:
        """From the engine's non-streamed answer (vLLM writes its null fields)."""
        if not isinstance(answer, dict) or not isinstance(answer.get("usage"), dict):
            raise FactsUnknown("the engine answered the one-token request without usage")
        fingerprint = answer.get("system_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise FactsUnknown(f"the engine's system_fingerprint is not a string: {fingerprint!r:.80}")
        usage = answer["usage"]
        uncounted = [f"usage.{key}" for key in ("prompt_tokens_details",) if usage.get(key) is not None]
        uncounted += ["metrics"] if answer.get("metrics") is not None else []
        return cls(fingerprint, usage.get("completion_tokens_details") is not None, tuple(uncounted))

    def why_not_continuous(self, fmt: str) -> str | None:
        """Why a resumed `fmt` stream with continuous usage cannot go on (every chunk's usage would differ), or None."""
        if fmt == "chat" and self.reasoning_tokens:
            return (
                "continuous usage with a reasoning parser: each chunk's usage has completion_tokens_details."
                "reasoning_tokens, which vLLM 0.32's token-in and derender routes do not count"
            )
        return None

    def why_no_usage(self, fmt: str) -> str | None:
        """Why a resumed `fmt` stream's usage chunk cannot be the engine's, or None when the front writes it exactly."""
        uncounted = [*self.uncounted]
        if fmt == "chat" and self.reasoning_tokens:
            uncounted.insert(0, "usage.completion_tokens_details.reasoning_tokens")
        if not uncounted:
            return None
        return (
            f"its text went out whole, but not its usage: the engine's usage has {', '.join(uncounted)}, which it "
            "counts only in a stream it generated from the start (vLLM 0.32's token-in and derender routes give "
            "none of them)"
        )
