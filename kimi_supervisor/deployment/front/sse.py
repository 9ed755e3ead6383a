"""Server-sent events as vLLM writes them (`data: {...}\n\n`, `data: [DONE]\n\n`): cut a byte stream into events,
and frame events the same way (the one place that writes the framing)."""

from __future__ import annotations

import json

DONE = b"[DONE]"


class EventSplitter:
    """Feed bytes as they come; get whole events (each without its blank-line terminator)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        *events, self._buf = self._buf.split(b"\n\n")
        return [e for e in events if e.strip()]


def data_of(event: bytes) -> bytes | None:
    """The event's data (its `data:` lines joined), or None for a comment or an event without data."""
    if event.startswith(b"data: ") and b"\n" not in event:  # vLLM's every event: one line
        return event[6:]
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def frame(datas: list[bytes]) -> bytes:
    """One event per data (each one line, as vLLM's), as one bytes: the events of one read go out in one write
    (the hot path: one join, not one copy per event)."""
    if not datas:
        return b""
    return b"data: " + b"\n\ndata: ".join(datas) + b"\n\n"


def encode(doc: object) -> bytes:
    """A chunk the front writes itself, in the bytes vLLM writes its own (pydantic's `model_dump_json`: no spaces,
    characters unescaped): a resumed stream's chunks read as the uninterrupted run's."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
