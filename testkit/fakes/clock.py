"""A Clock that advances only when slept on, with hooks that fire at given times."""

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


class RecordingLog:
    """Stands in for a structlog logger: records (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, object]]] = []

    def _log(self, level: str) -> Callable[..., None]:
        def emit(event: str, **fields: object) -> None:
            self.records.append((level, event, fields))

        return emit

    def __getattr__(self, level: str) -> Callable[..., None]:
        if level in ("debug", "info", "warning", "error", "critical", "exception"):
            return self._log(level)
        raise AttributeError(level)

    def events(self, name: str) -> list[dict[str, object]]:
        return [f for _, e, f in self.records if e == name]
