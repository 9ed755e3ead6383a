"""Signals: handlers only record and wake the loop (gunicorn's arbiter); the loop acts.

The wake-up is a non-blocking pipe the main loop selects on, so a signal that
arrives while it waits (for output, for GPU memory) is handled at once.

Every catchable signal whose default action would end the process is either a
stop request or ignored (logged), so nothing but SIGKILL or a real fault ends
the supervisor before it has stopped its tree:

- stop: SIGTERM, SIGINT, SIGQUIT, SIGPWR (a second one shortens the grace)
- ignored, logged: SIGHUP (no reload), SIGUSR1, SIGUSR2, SIGALRM, SIGIO, SIGPROF, SIGVTALRM, SIGXCPU,
  SIGSTKFLT and the real-time signals
- SIG_IGN: SIGPIPE (a closed reader is an EPIPE on that sink, nothing more)
- default: SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS, SIGABRT (faults of the interpreter itself;
  under systemd KillMode=mixed ends the tree), SIGXFSZ (Python already ignores it)

Ignored signals get a Python handler, not SIG_IGN: an ignored disposition would be inherited by vLLM
across exec, a handler is reset to the default there.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from typing import Any, Protocol

from kimi_supervisor.logs.types import Logger


class Signals(Protocol):
    """Signal handlers that only record and wake the loop through `read_fd` (signals.SignalRecorder)."""

    read_fd: int
    stop_requested: bool

    def install(self) -> None: ...

    def uninstall(self) -> None: ...

    def wake(self) -> None: ...

    def clear_wakeups(self) -> None: ...

    def new_signals(self) -> dict[int, int]: ...


STOP_SIGNALS = frozenset(
    s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, getattr(signal, "SIGPWR", None)) if s is not None
)
_IGNORED_NAMES = ("SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGIO", "SIGPROF", "SIGVTALRM", "SIGXCPU", "SIGSTKFLT")
IGNORED_SIGNALS = frozenset(
    [getattr(signal, n) for n in _IGNORED_NAMES if hasattr(signal, n)]
    + list(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))
)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signum >= signal.SIGRTMIN else str(signum)


class StopRequested(Exception):
    """A stop signal arrived while a blocking step (the preflight wait) was running."""


class SignalRecorder:
    """Handlers count the signal and wake the loop through a pipe; nothing else.

    Counts per signal number, not a list: the health prober wakes the loop on every probe (~17k a day),
    and a flood of SIGUSR1 must not grow memory either.
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self.stop_requested = False
        self.read_fd, self._write_fd = os.pipe()
        for fd in (self.read_fd, self._write_fd):
            os.set_blocking(fd, False)
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in sorted(STOP_SIGNALS | IGNORED_SIGNALS):
            with contextlib.suppress(OSError, ValueError):
                self._previous[sig] = signal.signal(sig, self._record)
        self._previous[signal.SIGPIPE] = signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)

    def _record(self, signum: int, frame: object) -> None:
        # A dict store of an int: atomic under the GIL, the handler cannot interleave with a reader's copy.
        self.counts[signum] = self.counts.get(signum, 0) + 1
        if signum in STOP_SIGNALS:
            self.stop_requested = True
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"s")

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"w")

    def clear_wakeups(self) -> None:
        try:
            while os.read(self.read_fd, 512):
                pass
        except OSError:
            pass

    def new_signals(self) -> dict[int, int]:
        """How often each signal arrived since the last call."""
        fresh: dict[int, int] = {}
        for sig, count in list(self.counts.items()):
            if count != self._seen.get(sig, 0):
                fresh[sig] = count - self._seen.get(sig, 0)
                self._seen[sig] = count
        return fresh


def stop_signalled(signals: Signals, log: Logger, state: str, *, sticky: bool = False) -> bool:
    """Was a stop requested?  The one answer: each signal that arrived since the last look is logged (a stop
    signal received, any other ignored), and True when one of them asks to stop.  `sticky`: also True when a
    stop signal arrived before, whoever looked at it then (a follower between its runs)."""
    fresh = signals.new_signals()
    for sig, count in fresh.items():
        if sig in STOP_SIGNALS:
            log.info("signal.received", signal=signal_name(sig), state=state, count=count)
        else:
            why = "reload is not supported; restart the unit" if sig == signal.SIGHUP else "not a stop request"
            log.warning("signal.ignored", signal=signal_name(sig), count=count, why=why)
    return any(s in STOP_SIGNALS for s in fresh) or (sticky and signals.stop_requested)


class InterruptibleClock:
    """A Clock whose sleep ends early, raising StopRequested, when a stop signal arrives.

    O(1) per wake-up: one flag, one selector made once.
    """

    def __init__(self, signals: Signals) -> None:
        self._signals = signals
        self._selector = selectors.DefaultSelector()
        self._selector.register(signals.read_fd, selectors.EVENT_READ)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if self._signals.stop_requested:
            raise StopRequested
        if self._selector.select(max(0.0, seconds)):
            # Ignored signals and wake-ups are counted already; a full pipe must not turn waits into spins.
            self._signals.clear_wakeups()
        if self._signals.stop_requested:
            raise StopRequested
