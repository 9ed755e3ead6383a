"""Whether the engine serves, and the bounded wait of requests that arrive while it does not (docs/front.md).

One object per front, used only from the front's event loop (asyncio: no locks).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from pathlib import Path

from kimi_supervisor.opsview.history import load_history


def last_load_s(history: Path | None) -> float | None:
    """The engine's last successful load (its supervisor's history), read-only: a corrupt file is left as it is."""
    if history is None:
        return None
    last = load_history(history, set_aside=False).last_successful_load()
    return None if last is None else last.load_s


class QueueFull(Exception):
    """queue_max requests wait already: this one is answered 503 at once."""


class EngineGate:
    def __init__(self, queue_max: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue_max = queue_max
        self.held = 0  # waiting now
        self._clock = clock
        self._serving = asyncio.Event()
        self.outages = 0
        self.outage_since: float | None = None  # when the engine stopped serving (None: serving, or never was)
        self.eta_s: float | None = None  # the engine's load ETA, from its supervisor's state file

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    def set_serving(self, serving: bool) -> bool:
        """True when this changed the state."""
        if serving == self.serving:
            return False
        if serving:
            self._serving.set()
            self.outage_since = None
        else:
            self._serving.clear()
            self.outages += 1
            self.outage_since = self._clock()
        return True

    async def wait(self, timeout_s: float) -> bool:
        """True once the engine serves (at once if it does), False after `timeout_s`; QueueFull when
        queue_max requests wait already.  A cancelled waiter (its client left) frees its place at once."""
        if self.serving:
            return True
        if self.held >= self.queue_max:
            raise QueueFull
        self.held += 1
        try:
            await asyncio.wait_for(self._serving.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.held -= 1

    def retry_after_s(self, hold_s: float) -> int:
        """Retry-After: the engine's load ETA when its supervisor knows one, else the hold bound."""
        seconds = self.eta_s if self.eta_s is not None else hold_s
        return max(1, math.ceil(seconds))
