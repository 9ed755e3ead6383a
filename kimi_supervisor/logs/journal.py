"""Logging: structlog for the supervisor's events, a fast path for child lines.

Under systemd (JOURNAL_STREAM names our stderr) records go to journald over its
native protocol, so each carries PRIORITY (`journalctl -p warning` filters) and
fields: KIMI_SOURCE=supervisor|child, KIMI_EVENT for events, VLLM_COMPONENT /
VLLM_RANK / VLLM_PID for child lines, and on every record KIMI_DEPLOYMENT (the deployment's name) with
SYSLOG_IDENTIFIER naming its unit (`kimi-supervisor`, or `kimi-supervisor@NAME` for an instance of the
template), so several deployments of one host are told apart in one journal.  On a terminal: a readable console; else
JSON lines.  Child lines skip structlog's processor chain: a 9-minute load is
quiet, but a chatty child must never be slowed by its supervisor.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, TextIO, cast

from kimi_supervisor.logs.catalog import message_id
from kimi_supervisor.logs.fdwriter import RECORD_BUFFER, RecordStream, Writer, writer_for
from kimi_supervisor.logs.plainstructlog import structlog
from kimi_supervisor.logs.types import Logger
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
    """Sends records to journald's native socket without ever blocking; falls back to `<N>`-prefixed stderr.

    The socket is non-blocking: when journald stalls (its queue full), the supervisor's own records wait in
    a bounded backlog and go first once it takes datagrams again; child lines are dropped and counted
    (`take_dropped`), never queued.
    """

    def __init__(
        self,
        path: str = JOURNAL_SOCKET,
        fallback: TextIO | RecordStream | None = None,
        backlog: int = 10_000,
        identity: Mapping[str, str] | None = None,
    ) -> None:
        self._fallback = fallback or sys.stderr
        # On every record: which deployment (and unit) it is; a record's own fields cannot override them.
        self._identity: dict[str, str] = {"SYSLOG_IDENTIFIER": IDENTIFIER, **(identity or {})}
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_max = backlog
        self.dropped = 0  # child lines dropped while journald stalled, not yet reported
        self.lost_records = 0  # supervisor records lost (backlog full): the bench's "target 0"
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.connect(path)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            self._sock = None

    def send(self, priority: int, message: str, fields: Mapping[str, object]) -> None:
        """A supervisor record: sent now, or queued behind a stall; never dropped while the backlog has room."""
        data = self._encode(priority, message, fields)
        if self._sock is None:
            self._to_fallback(priority, message)
            return
        self.flush()
        if self._backlog:
            self._queue(data)
            return
        result = self._try(data)
        if result == "stalled":
            self._queue(data)
        elif result == "failed":
            self._to_fallback(priority, message)

    def send_child(self, priority: int, message: str, fields: Mapping[str, object]) -> None:
        """A child line: sent now if journald takes it and no record is waiting, else dropped and counted."""
        if self._sock is None:
            self._to_fallback(priority, message)
            return
        if self._backlog:
            self.dropped += 1
            return
        result = self._try(self._encode(priority, message, fields))
        if result == "stalled":
            self.dropped += 1
        elif result == "failed":
            self._to_fallback(priority, message)

    def flush(self) -> None:
        while self._backlog:
            result = self._try(self._backlog[0])
            if result == "stalled":
                return
            self._backlog.popleft()  # sent, or failed for good (too large): not retried forever

    @property
    def pending(self) -> int:
        return len(self._backlog)

    def take_dropped(self, final: bool = False) -> int:
        if not self.dropped or (self._backlog and not final):
            return 0
        n, self.dropped = self.dropped, 0
        return n

    def _encode(self, priority: int, message: str, fields: Mapping[str, object]) -> bytes:
        record: dict[str, object] = {"MESSAGE": message, "PRIORITY": priority}
        record.update(fields)
        record.update(self._identity)
        return encode_journal(record)

    def _try(self, data: bytes) -> str:
        assert self._sock is not None
        try:
            self._sock.send(data)
            return "sent"
        except (BlockingIOError, InterruptedError):
            return "stalled"
        except OSError as exc:
            # ENOBUFS is the kernel's "queue full" for some datagram sockets: a stall too.
            return "stalled" if exc.errno == errno.ENOBUFS else "failed"

    def _queue(self, data: bytes) -> None:
        if len(self._backlog) >= self._backlog_max:
            self.lost_records += 1
            return
        self._backlog.append(data)

    def _to_fallback(self, priority: int, message: str) -> None:
        # journald restarting or the record too large: keep it on stderr (its stream goes to the journal too).
        try:
            self._fallback.write(f"<{priority}>{message}\n")
            self._fallback.flush()
        except (OSError, ValueError):
            pass


class ChildSink(Protocol):
    """Where the child's output lines go; never blocks (output.py meters and reports what it drops)."""

    name: str
    # journald rate-limits per unit and priority: what goes there is metered so the supervisor's own
    # records always fit; stdout too, so that formatting a flood never costs the loop more than a few
    # percent of a core (see output.LineMeter).
    metered: bool

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None: ...

    def flush(self) -> None: ...

    @property
    def pending(self) -> int: ...

    def take_dropped(self, final: bool = False) -> int:
        """Child lines dropped because the reader stalled, once it reads again (`final`: now, at exit)."""
        ...

    def close(self, timeout_s: float) -> None: ...


class ConsoleChildSink:
    """Child lines as they are (vLLM's own prefixes already say who spoke), to stdout."""

    name = "stdout"
    metered = True

    def __init__(self, stream: TextIO | None = None, records: Writer | None = None) -> None:
        self._writer = writer_for(stream or sys.stdout)
        self._records = records  # the supervisor's records: flushed with the lines
        self._pending: list[str] = []

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        self._pending.append(text)
        if len(self._pending) >= 256:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._writer.write(("\n".join(self._pending) + "\n").encode("utf-8", "replace"), len(self._pending))
            self._pending.clear()
        else:
            self._writer.flush()
        if self._records is not None:
            self._records.flush()

    @property
    def pending(self) -> int:
        return self._writer.pending + (self._records.pending if self._records is not None else 0)

    def take_dropped(self, final: bool = False) -> int:
        return self._writer.take_dropped(final)

    def close(self, timeout_s: float) -> None:
        self.flush()
        self._writer.finish(timeout_s)
        self._writer.abandon()  # what the reader did not take in time: dropped and counted (take_dropped)
        self._writer.close()


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
    name = "journal"
    metered = True

    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        self._writer.send_child(priority, text, {"KIMI_SOURCE": "child", **fields})

    def flush(self) -> None:
        self._writer.flush()

    @property
    def pending(self) -> int:
        return self._writer.pending

    def take_dropped(self, final: bool = False) -> int:
        return self._writer.take_dropped(final)

    def close(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._writer.pending and time.monotonic() < deadline:
            self._writer.flush()
            time.sleep(0.01)


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
        known = message_id(event)
        if known is not None:  # our lifecycle events: a stable id for `journalctl MESSAGE_ID=` and the catalog
            fields["MESSAGE_ID"] = known
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
    identity: Mapping[str, str] | None = None,
) -> ChildSink:
    """Set up structlog for `fmt` (already resolved) and return the matching child-line sink.  `identity`:
    journal fields on every record (SYSLOG_IDENTIFIER, KIMI_DEPLOYMENT), once the config names them."""
    err = RecordStream(_records_writer(stream or sys.stderr))
    scrubber = SecretScrubber(secrets)
    threshold = _LEVEL_ORDER[level]

    def drop_below(logger: object, name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if _LEVEL_ORDER.get(name if name != "exception" else "error", 20) < threshold:
            raise structlog.DropEvent
        return event_dict

    processors: list[Any] = [drop_below, structlog.processors.add_log_level, scrubber]
    if fmt == "journal":
        writer = JournalWriter(journal_socket, fallback=err, identity=identity)
        processors += [structlog.processors.format_exc_info, _journal_renderer]
        structlog.configure(
            processors=processors, logger_factory=lambda *a: _JournalLogger(writer), cache_logger_on_first_use=False
        )
        return JournalChildSink(writer)
    processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        sink: ChildSink = JsonChildSink(sys.stdout if stream is None else stream, err.writer)
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=err.isatty()))
        sink = ConsoleChildSink(sys.stdout if stream is None else stream, err.writer)
    structlog.configure(
        processors=processors,
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, err)),
        cache_logger_on_first_use=False,
    )
    return sink


_RECORD_WRITERS: dict[int, Writer] = {}


def _records_writer(stream: TextIO) -> Writer:
    """One writer per stream (configure runs twice: before and after the config names the secrets)."""
    key = id(stream)
    if key not in _RECORD_WRITERS:
        _RECORD_WRITERS[key] = writer_for(stream, RECORD_BUFFER)
    return _RECORD_WRITERS[key]


def close_outputs(timeout_s: float = 1.0) -> None:
    """At exit: let readers take what is buffered (bounded), then give blocking fds back as they were."""
    for writer in _RECORD_WRITERS.values():
        writer.finish(timeout_s)
        writer.close()


def get_logger() -> Logger:
    logger: Logger = structlog.get_logger()
    return logger
