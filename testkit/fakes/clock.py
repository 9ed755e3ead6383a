"""The fake clock: a Clock that advances only when slept on, with hooks that fire at given times."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._hooks: list[tuple[float, Callable[[], None]]] = []

    def at(self, elapsed: float, action: Callable[[], None]) -> None:
        self._hooks.append((self.now + elapsed, action))
        self._hooks.sort(key=lambda h: h[0])

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)
        while self._hooks and self._hooks[0][0] <= self.now:
            self._hooks.pop(0)[1]()
