"""Classify one line of vLLM output: who said it and how loud.

vLLM prefixes lines with the process that logged them, `(APIServer pid=213806)`,
`(EngineCore_DP0 pid=...)`, `(Worker_TP3 pid=...)`, followed by its level; uvicorn
writes `INFO:     ...`; tracebacks come unprefixed.  The result becomes the
journal PRIORITY (INFO 6, WARNING 4, ERROR 3, tracebacks 3) and fields.
"""

from __future__ import annotations

import dataclasses
import enum
import re

_PREFIX = re.compile(
    r"^\((?P<comp>[A-Za-z][\w:.-]*?)(?:[_ ](?:TP|DP|PP|EP|rank=?)?(?P<rank>\d+))?\s+pid=(?P<pid>\d+)\)\s*"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)?"
)
_BARE_LEVEL = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?::|\s+\d\d-\d\d )")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)")
# uvicorn's access line, bare (`INFO:     1.2.3.4:5 - "GET /x HTTP/1.1" 404 Not Found`, vLLM 0.32) or inside a
# vLLM-formatted record (`... INFO 11-29 17:07:32 [h11_impl.py:473] 1.2.3.4:5 - "GET ...`): what follows the
# client's address is the client's own text.
_ACCESS = re.compile(r'^:?\s*(?:\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? )?(?:\[[^\]]*\] )?\S+:\d+ - "')
# vLLM's record header after the level: `11-29 17:08:21 [multiproc_executor.py:315] `.  Its formatter gives every
# line of a multi-line message the same header, so a newline in logged client text cannot start a line with
# another file's header: the file named here is the code that logged the record.
_HEADER = re.compile(r"^\s*(?:\d\d-\d\d\s+)?\d\d:\d\d:\d\d(?:\.\d+)?\s+\[(?P<file>[^\]\s:]+):(?P<lineno>\d+)\]\s?")
PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class Kind(enum.Enum):
    RECORD = "record"  # a log record of the server itself: `(Comp pid=N) LEVEL ...`, `LEVEL:  ...`
    ACCESS = "access"  # one request, as uvicorn logs it: client-controlled text
    TRACEBACK = "traceback"  # an unprefixed traceback, its exception line, or a bare `XxxError: ...` line
    OTHER = "other"  # anything else: tqdm bars, warnings.warn, a library's print


@dataclasses.dataclass(frozen=True)
class ChildLine:
    text: str
    priority: int
    fields: dict[str, str]
    kind: Kind
    # A vLLM record's header: the file that logged it (as vLLM prints it: a base name, or a shortened
    # relative path with VLLM_LOGGING_... relpath), and the message after the header.  None otherwise.
    source: str | None = None
    message: str = ""

    @property
    def may_be_fatal(self) -> bool:
        """Fatal patterns and root causes only ever look at ERROR+ records and tracebacks."""
        return self.kind is Kind.TRACEBACK or (self.kind is Kind.RECORD and self.priority <= 3)

    @property
    def may_start(self) -> bool:
        """ "The server started" is only ever a record of the server itself, never a request line."""
        return self.kind is Kind.RECORD

    @property
    def may_show_progress(self) -> bool:
        """Phases and loading progress: the server's records and its unprefixed progress bars."""
        return self.kind is Kind.RECORD or self.kind is Kind.OTHER


class LineClassifier:
    """Stateful per stream: a traceback spans lines until its exception line."""

    def __init__(self, default_priority: int = 6) -> None:
        self._default = default_priority
        self._in_traceback = False

    @property
    def in_traceback(self) -> bool:
        """Inside an unprefixed traceback: every line until its exception line is part of it (output.py)."""
        return self._in_traceback

    def classify(self, line: str) -> tuple[int, dict[str, str]]:
        c = self.classify_line(line)
        return c.priority, c.fields

    def classify_line(self, line: str) -> ChildLine:
        fields: dict[str, str] = {}
        body = line
        level = None
        m = _PREFIX.match(line)
        if m:
            fields["VLLM_COMPONENT"] = m.group("comp")
            if m.group("rank") is not None:
                fields["VLLM_RANK"] = m.group("rank")
            fields["VLLM_PID"] = m.group("pid")
            body = line[m.end() :]
            level = m.group("level")
        else:
            b = _BARE_LEVEL.match(line)
            if b:
                level = b.group("level")
                body = line[b.end() :]
        if level is not None:
            # A record interleaved into another process's traceback neither ends it nor joins it.
            priority = PRIORITY[level]
            if _ACCESS.match(body):
                return ChildLine(line, priority, fields, Kind.ACCESS)
            h = _HEADER.match(body)
            if h is None:
                return ChildLine(line, priority, fields, Kind.RECORD, None, body.strip())
            return ChildLine(line, priority, fields, Kind.RECORD, h.group("file"), body[h.end() :].rstrip())
        stripped = body.lstrip()
        if stripped.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
            return ChildLine(line, 3, fields, Kind.TRACEBACK)
        if self._in_traceback:
            if (
                body[:1] in (" ", "\t")
                or not stripped
                or stripped.startswith(("During handling", "The above exception"))
            ):
                return ChildLine(line, 3, fields, Kind.TRACEBACK)
            self._in_traceback = False
            return ChildLine(line, 3, fields, Kind.TRACEBACK)  # the exception line closes the traceback
        if _EXCEPTION_LINE.match(stripped):
            return ChildLine(line, 3, fields, Kind.TRACEBACK)
        return ChildLine(line, self._default, fields, Kind.OTHER)


# The end of uvicorn's access line: the status and its phrase after the client's quoted request
# (`... "GET /health HTTP/1.1" 200 OK`); matched at the end, after whatever the client wrote inside the quotes.
_ACCESS_STATUS = re.compile(r'" ([1-5]\d\d) [^"]*$')


def answered_ok(line: ChildLine) -> bool:
    """An access line of a request the server answered below 400: our own /health probes, mostly, which fill the
    last lines of a run that failed while serving and explain nothing of the failure."""
    if line.kind is not Kind.ACCESS:
        return False
    status = _ACCESS_STATUS.search(line.text.rstrip())
    return status is not None and int(status.group(1)) < 400
