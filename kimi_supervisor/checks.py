"""One check's verdict (`Check`, `Verdict`): what the preflight, check-config and the stop timeouts report.

A leaf, so the config level (timeouts.py) can report a check without importing the preflight.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class Verdict(str, enum.Enum):
    OK = "ok"
    WAIT = "would wait"  # dry run: a real start would wait (and may fail at the deadline)
    KILL = "would kill"
    REMOVE = "would remove"
    DONE = "done"  # a real run did what the dry run would have said
    KEEP = "keep"
    SKIP = "skip"
    WARN = "warn"  # a start proceeds, but someone should look
    NA = "n/a"  # the hardware does not support this check
    FAIL = "failed"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    message: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def blocking(self) -> bool:
        return self.verdict in (Verdict.FAIL, Verdict.WAIT)
