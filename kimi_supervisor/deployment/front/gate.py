"""The bounded wait of requests that arrive while no engine serves (docs/front.md, Holding); how long it is, is
records.py's hold_bound.

One object per front, used only from the front's event loop (asyncio: no locks).  Which engine serves is the
pool's (engine.py); the gate counts who waits for it and turns them away past `queue_max`.
"""

from __future__ import annotations

import math

from kimi_supervisor.deployment.front.engine import EnginePool


class QueueFull(Exception):
    """queue_max requests wait already: this one is answered 503 at once."""


class EngineGate:
    def __init__(self, engines: EnginePool, queue_max: int, hold_s: float) -> None:
        self.engines = engines
        self.queue_max = queue_max
        self.hold_s = hold_s
        self.held = 0  # waiting now

    async def wait(self) -> bool:
        """True once an engine serves (at once if one does), False after hold_s; QueueFull when queue_max
        requests wait already.  A cancelled waiter (its client left) frees its place at once."""
        if self.engines.serving:
            return True
        if self.held >= self.queue_max:
            raise QueueFull
        self.held += 1
        try:
            return await self.engines.until_serving(self.hold_s)
        finally:
            self.held -= 1

    def retry_after_s(self) -> int:
        """Retry-After: the engine's load ETA when its supervisor knows one, else the hold bound."""
        eta = self.engines.eta_s
        seconds = eta if eta is not None else self.hold_s
        return max(1, math.ceil(seconds))
