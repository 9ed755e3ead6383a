"""Signals: handlers only record and wake the loop (gunicorn's arbiter); the loop acts.

The wake-up is a non-blocking pipe the main loop selects on, so a signal that
arrives while it waits (for output, for GPU memory) is handled at once.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """A stop signal arrived while a blocking step (the preflight wait) was running."""


class SignalRecorder:
    """Handlers append the signal and wake the loop through a pipe; nothing else."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.handled = 0
        self.read_fd, self._write_fd = os.pipe()
        for fd in (self.read_fd, self._write_fd):
            os.set_blocking(fd, False)
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (*STOP_SIGNALS, signal.SIGHUP):
            self._previous[sig] = signal.signal(sig, self._record)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"s")

    def wake(self) -> None:
        self._record(0, None)

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 512):
                pass
        except OSError:
            pass

    def new_signals(self) -> list[int]:
        """Signals recorded since the last call (0 is a wake-up, not a signal)."""
        fresh = self.received[self.handled :]
        self.handled = len(self.received)
        return [s for s in fresh if s != 0]


class InterruptibleClock:
    """A Clock whose sleep ends early, raising StopRequested, when a stop signal arrives."""

    def __init__(self, signals: SignalRecorder) -> None:
        self._signals = signals

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if any(s in STOP_SIGNALS for s in self._signals.received):
            raise StopRequested
        with selectors.DefaultSelector() as sel:
            sel.register(self._signals.read_fd, selectors.EVENT_READ)
            sel.select(max(0.0, seconds))
        if any(s in STOP_SIGNALS for s in self._signals.received):
            raise StopRequested
