"""The `Logger` the package takes: a leaf, so any module that logs can name it without an import cycle."""

from __future__ import annotations

from typing import Any, Protocol


class Warns(Protocol):
    """All a reader that only collects problems needs (status.py's notes on a history it reads)."""

    def warning(self, event: str, **fields: Any) -> Any: ...


class Logger(Warns, Protocol):
    """The structlog calls the package makes: an event name and fields."""

    def debug(self, event: str, **fields: Any) -> Any: ...

    def info(self, event: str, **fields: Any) -> Any: ...

    def error(self, event: str, **fields: Any) -> Any: ...

    def critical(self, event: str, **fields: Any) -> Any: ...
