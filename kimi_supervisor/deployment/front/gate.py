"""The bounded wait of requests that arrive while no engine serves, and how long it is (docs/front.md, Holding).

One object per front, used only from the front's event loop (asyncio: no locks).  Which engine serves is the
pool's (engine.py); the gate counts who waits for it and turns them away past `queue_max`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from kimi_supervisor.config.front import HOLD_MARGIN_S, FrontConfig, hold_from_history
from kimi_supervisor.deployment.front.records import EngineRecords

if TYPE_CHECKING:  # engine.py imports aiohttp; role.py's dry run imports hold_bound from here on any host
    from kimi_supervisor.deployment.front.engine import EnginePool


class HoldBound(NamedTuple):
    seconds: float
    whence: str  # where the number came from (`--dry-run` says it)


def hold_bound(cfg: FrontConfig) -> HoldBound:
    """How long a request waits for the engine: front.hold_s, else the engine's last load plus a margin."""
    if cfg.hold_s is not None:
        return HoldBound(cfg.hold_s, "front.hold_s")
    last = EngineRecords.of(cfg).last_load_s()
    whence = f"the engine's last load {last:g}s + {HOLD_MARGIN_S:g}s" if last is not None else "no engine history yet"
    return HoldBound(hold_from_history(last), whence)


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
