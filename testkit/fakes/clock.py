"""The one fake clock: monotonic and wall time that move only when slept or waited on, and actions that run
when the clock reaches their time.

Every test that needs fake time uses it: the preflight's `Clock` (monotonic, sleep), the lifecycle's
(testkit/fakes/lifecycle.py: its selector and signals wait on it, `Deps.wall` is its `time`), the operator
view's and the output meter's callables (`clock.monotonic`).  tests/test_comment_paths.py fails when a
second fake clock class appears.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

T0 = 1000.0
WALL_T0 = 1_700_000_000.0  # the wall clock at the fake start: the state file's timestamps follow the fake clock
HORIZON_S = 100_000.0  # a loop that never ends fails the test instead of spinning forever


class FakeClock:
    """Fake monotonic time; actions scheduled at times since the start run when the clock reaches them."""

    def __init__(self) -> None:
        self.now = T0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    @property
    def t(self) -> float:
        """Seconds since the start."""
        return self.now - T0

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (T0 + t, next(self._seq), action))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        self.at(self.t + seconds, action)

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        """Wall-clock time (`Deps.wall`), advancing with the fake clock."""
        return WALL_T0 + self.t

    def sleep(self, seconds: float) -> None:
        end = self.now + max(0.0, seconds)
        while self._events and self._events[0][0] <= end:
            self.wait(end - self.now)
        self.now = end

    def wait(self, timeout: float) -> None:
        """Advance to the next event (running every action due then) or by `timeout`, whichever is first."""
        end = self.now + max(0.0, timeout)
        if self._events and self._events[0][0] <= end:
            end = max(self.now, self._events[0][0])
        self.now = end
        if self.now - T0 > HORIZON_S:
            raise AssertionError(f"the fake clock ran past {HORIZON_S:g}s: the loop never ended")
        while self._events and self._events[0][0] <= self.now:
            heapq.heappop(self._events)[2]()
