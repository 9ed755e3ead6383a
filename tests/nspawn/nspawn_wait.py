"""Waiting on a booted machine: poll a predicate, read systemd's timespans, and prove a failed unit is not
restarted (expect_no_restart)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from nspawn import NspawnMachine

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.1,
    message: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value.

    Raises ``TimeoutError`` after ``timeout`` seconds.  Exceptions raised by the
    predicate propagate immediately.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {message}")
        time.sleep(interval)


_TIMESPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def timespan_s(text: str) -> float:
    """A timespan as `systemctl show` prints it ("500ms", "1min 30s", "0") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(us|ms|min|s|h)?", text.strip())
    if not parts or re.sub(r"[\d.\s]|us|ms|min|s|h", "", text):
        raise ValueError(f"not a systemd timespan: {text!r}")
    return sum(float(n) * _TIMESPAN_UNITS[u or "s"] for n, u in parts)


def expect_no_restart(m: NspawnMachine, unit: str, margin: float = 1.0) -> None:
    """Assert that systemd decided not to restart ``unit``, which has just failed.

    With a restart pending the unit sits in SubState ``auto-restart``, never ``failed``, so
    ``failed`` is the decision itself. To catch a restart that comes anyway, keep checking until
    RestartSec (+ ``margin``) has passed since the unit went inactive by systemd's own timestamp:
    a bound, not a guess of how slow this host is. The container shares the host's CLOCK_MONOTONIC
    (nspawn makes no time namespace), so the host's time.monotonic() compares with it.
    """

    def state() -> tuple[str, ...]:
        return tuple(m.unit_property(unit, p) for p in ("ActiveState", "SubState", "NRestarts"))

    assert state() == ("failed", "failed", "0"), state()
    went_inactive = int(m.unit_property(unit, "InactiveEnterTimestampMonotonic")) / 1e6
    bound = went_inactive + timespan_s(m.unit_property(unit, "RestartUSec")) + margin

    def past_bound() -> bool:
        assert state() == ("failed", "failed", "0"), f"{unit} restarted after all: {state()}"
        return time.monotonic() > bound

    wait_for(past_bound, timeout=max(0.0, bound - time.monotonic()) + 10, interval=0.2, message="RestartSec to pass")
