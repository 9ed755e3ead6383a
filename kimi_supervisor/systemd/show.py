"""What the running systemd says: is it PID 1, and the installed unit's TimeoutStopSec (`systemctl show`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable

_SPAN_UNITS = {
    "us": 1e-6,
    "usec": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "w": 604800.0,
    "week": 604800.0,
    "weeks": 604800.0,
}


def parse_timespan(text: str) -> float | None:
    """systemd's time span ("1min 30s", "90", "infinity") in seconds; None for infinity or unparseable."""
    text = text.strip()
    if not text or text == "infinity":
        return None
    total = 0.0
    pos = 0
    for m in re.finditer(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", text):
        if m.start() != pos:
            return None
        unit = m.group(2) or "s"
        if unit not in _SPAN_UNITS:
            return None
        total += float(m.group(1)) * _SPAN_UNITS[unit]
        pos = m.end()
    return total if pos == len(text) else None


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=10)


def systemd_running() -> bool:
    # sd_booted(3): the directory exists only when systemd is PID 1.
    return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None


def installed_stop_timeout_s(unit_name: str, runner: Runner = _run) -> float | None:
    """The loaded unit's TimeoutStopSec in seconds; None when systemd, the unit or the value is unknown."""
    try:
        result = runner(["systemctl", "show", unit_name, "-p", "LoadState", "-p", "TimeoutStopUSec"])
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    props = dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)
    if props.get("LoadState") != "loaded":
        return None  # not installed: systemctl would report the manager's default
    return parse_timespan(props.get("TimeoutStopUSec", ""))
