"""Signals: handlers only record and wake the loop (gunicorn's arbiter); the loop acts.

The wake-up is a non-blocking pipe the reactor (reactor.py) selects on, so a signal that arrives while
the main thread waits (for output, for GPU memory) is handled at once; the reactor drains the pipe and
gives the one answer to "was a stop requested?" (`Reactor.stop_signalled`).

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
import signal
from typing import Any, Protocol


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
    """A stop signal arrived while a blocking step (the preflight wait) was running (reactor.ReactorClock)."""


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
