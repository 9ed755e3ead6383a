"""Logging: structlog for the supervisor's events, a fast path for child lines.

Under systemd (JOURNAL_STREAM names our stderr) records go to journald over its
native protocol, so each carries PRIORITY (`journalctl -p warning` filters) and
fields: KIMI_SOURCE=supervisor|child, KIMI_EVENT for events, VLLM_COMPONENT /
VLLM_RANK / VLLM_PID for child lines.  On a terminal: a readable console; else
JSON lines.  Child lines skip structlog's processor chain: a 9-minute load is
quiet, but a chatty child must never be slowed by its supervisor.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, TextIO

import structlog

from kimi_supervisor.redact import is_secret_name, redact_text

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "kimi-supervisor"
FORMATS = ("auto", "console", "json", "journal")
_LEVEL_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
_LEVEL_ORDER = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def journal_stream_is_stderr(environ: Mapping[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """systemd sets JOURNAL_STREAM=dev:inode for the stream it connected to journald."""
    value = (environ if environ is not None else os.environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat((stream or sys.stderr).fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def resolve_format(requested: str) -> str:
    if requested != "auto":
        return requested
    if journal_stream_is_stderr():
        return "journal"
    return "console" if sys.stderr.isatty() else "json"


def _field_name(key: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in key.upper()).lstrip("_")
    return name or "FIELD"


def encode_journal(fields: Mapping[str, object]) -> bytes:
    """journald native protocol: KEY=value lines; binary-safe form for values with newlines."""
    out = bytearray()
    for key, value in fields.items():
        data = str(value).encode("utf-8", "replace")
        name = key.encode("ascii")
        if b"\n" in data:
            out += name + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name + b"=" + data + b"\n"
    return bytes(out)


class JournalWriter:
    """Sends records to journald's native socket; falls back to `<N>`-prefixed stderr."""

    def __init__(self, path: str = JOURNAL_SOCKET, fallback: TextIO | None = None) -> None:
        self._path = path
        self._fallback = fallback or sys.stderr
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            self._sock = None

    def send(self, priority: int, message: str, fields: Mapping[str, object]) -> None:
        record: dict[str, object] = {"MESSAGE": message, "PRIORITY": priority, "SYSLOG_IDENTIFIER": IDENTIFIER}
        record.update(fields)
        if self._sock is not None:
            try:
                self._sock.send(encode_journal(record))
                return
            except OSError:
                pass  # journald restarting or message too large: keep the line on stderr
        self._fallback.write(f"<{priority}>{message}\n")
        self._fallback.flush()


class ChildSink(Protocol):
    """Where the child's output lines go."""

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None: ...

    def flush(self) -> None: ...


class ConsoleChildSink:
    """Child lines as they are (vLLM's own prefixes already say who spoke)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._pending: list[str] = []

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        self._pending.append(text)
        if len(self._pending) >= 256:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._stream.write("\n".join(self._pending) + "\n")
            self._pending.clear()
            self._stream.flush()


class JsonChildSink(ConsoleChildSink):
    """One JSON object per child line, formatted by hand: json.dumps per line costs 3 µs, this 1 µs."""

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        extra = "".join(f", {_json_str(k.lower())}: {_json_str(v)}" for k, v in fields.items())
        record = f'{{"source": "child", "priority": {int(priority)}, "line": {_json_str(text)}{extra}}}'
        super().line(record, priority, fields)


def _json_str(value: str) -> str:
    # The same escaping json.dumps(..., ensure_ascii=False) applies to a string.
    return json.encoder.encode_basestring(value)


class JournalChildSink:
    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        self._writer.send(priority, text, {"KIMI_SOURCE": "child", **fields})

    def flush(self) -> None:
        pass


class SecretScrubber:
    """structlog processor: redacts values of secret-looking keys and known secret values."""

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        self.secrets = secrets

    def __call__(self, logger: object, name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in list(event_dict.items()):
            if is_secret_name(key):
                event_dict[key] = "<redacted>"
            elif isinstance(value, str) and self.secrets:
                event_dict[key] = redact_text(value, self.secrets)
        return event_dict


class _JournalLogger:
    """structlog 'logger' whose methods take the already-processed event dict."""

    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer

    def _emit(self, event_dict: Mapping[str, Any]) -> None:
        ed = dict(event_dict)
        level = str(ed.pop("level", "info"))
        event = str(ed.pop("event", ""))
        ed.pop("timestamp", None)
        exc = ed.pop("exception", None)
        text = " ".join([event] + [f"{k}={_short(v)}" for k, v in ed.items()])
        fields = {"KIMI_SOURCE": "supervisor", "KIMI_EVENT": event}
        fields.update({f"KIMI_{_field_name(k)}": str(v) for k, v in ed.items() if v is not None})
        self._writer.send(_LEVEL_PRIORITY.get(level, 6), text + (f"\n{exc}" if exc else ""), fields)

    def msg(self, *, event_dict: Mapping[str, Any]) -> None:
        self._emit(event_dict)

    debug = info = warning = error = critical = exception = msg


def _short(value: object) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def _journal_renderer(
    logger: object, name: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[()], dict[str, Any]]:
    event_dict["level"] = name if name != "exception" else "error"
    return (), {"event_dict": event_dict}


def configure(
    fmt: str,
    level: str = "info",
    secrets: tuple[str, ...] = (),
    stream: TextIO | None = None,
    journal_socket: str = JOURNAL_SOCKET,
) -> ChildSink:
    """Set up structlog for `fmt` (already resolved) and return the matching child-line sink."""
    err = stream or sys.stderr
    scrubber = SecretScrubber(secrets)
    threshold = _LEVEL_ORDER[level]

    def drop_below(logger: object, name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if _LEVEL_ORDER.get(name if name != "exception" else "error", 20) < threshold:
            raise structlog.DropEvent
        return event_dict

    processors: list[Any] = [drop_below, structlog.processors.add_log_level, scrubber]
    if fmt == "journal":
        writer = JournalWriter(journal_socket, fallback=err)
        processors += [structlog.processors.format_exc_info, _journal_renderer]
        structlog.configure(
            processors=processors, logger_factory=lambda *a: _JournalLogger(writer), cache_logger_on_first_use=False
        )
        return JournalChildSink(writer)
    processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        sink: ChildSink = JsonChildSink(sys.stdout if stream is None else stream)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=err.isatty()))
        sink = ConsoleChildSink(sys.stdout if stream is None else stream)
    structlog.configure(
        processors=processors, logger_factory=structlog.PrintLoggerFactory(err), cache_logger_on_first_use=False
    )
    return sink


def get_logger() -> Any:
    return structlog.get_logger()
