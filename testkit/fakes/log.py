"""A log that records: stands in for the supervisor's structlog logger in tests."""

from __future__ import annotations

from collections.abc import Callable


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
