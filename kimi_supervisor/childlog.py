"""Classify one line of vLLM output: who said it and how loud.

vLLM prefixes lines with the process that logged them, `(APIServer pid=213806)`,
`(EngineCore_DP0 pid=...)`, `(Worker_TP3 pid=...)`, followed by its level; uvicorn
writes `INFO:     ...`; tracebacks come unprefixed.  The result becomes the
journal PRIORITY (INFO 6, WARNING 4, ERROR 3, tracebacks 3) and fields.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(
    r"^\((?P<comp>[A-Za-z][\w:.-]*?)(?:[_ ](?:TP|DP|PP|EP|rank=?)?(?P<rank>\d+))?\s+pid=(?P<pid>\d+)\)\s*"
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)?"
)
_BARE_LEVEL = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?::|\s+\d\d-\d\d )")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)")
PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class LineClassifier:
    """Stateful per stream: a traceback spans lines until its exception line."""

    def __init__(self, default_priority: int = 6) -> None:
        self._default = default_priority
        self._in_traceback = False

    def classify(self, line: str) -> tuple[int, dict[str, str]]:
        fields: dict[str, str] = {}
        body = line
        m = _PREFIX.match(line)
        priority = self._default
        if m:
            fields["VLLM_COMPONENT"] = m.group("comp")
            if m.group("rank") is not None:
                fields["VLLM_RANK"] = m.group("rank")
            fields["VLLM_PID"] = m.group("pid")
            body = line[m.end() :]
            if m.group("level"):
                priority = PRIORITY[m.group("level")]
        else:
            b = _BARE_LEVEL.match(line)
            if b:
                priority = PRIORITY[b.group("level")]
        stripped = body.lstrip()
        if stripped.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
            return 3, fields
        if self._in_traceback:
            if (
                body[:1] in (" ", "\t")
                or not stripped
                or stripped.startswith(("During handling", "The above exception"))
            ):
                return 3, fields
            self._in_traceback = False
            return 3, fields  # the exception line closes the traceback
        if _EXCEPTION_LINE.match(stripped) and priority > 3:
            priority = 3
        return priority, fields
