"""What lower layers register with to be woken on the main thread (lifecycle/reactor.py's `Reactor`).

The reactor lives above child/ and liveness/; those layers see only these Protocols, so a pipe, a timer or
a per-turn duty is registered without importing the loop that owns them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Wakeups(Protocol):
    """One selector and every timer of the main thread: handlers run on it, between the loop's looks."""

    def monotonic(self) -> float: ...

    def add_reader(self, fd: int, handler: Callable[[], None]) -> None: ...

    def remove_reader(self, fd: int) -> None: ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer: ...

    def add_turn_hook(self, fn: Callable[[], None]) -> None: ...

    def remove_turn_hook(self, fn: Callable[[], None]) -> None: ...
