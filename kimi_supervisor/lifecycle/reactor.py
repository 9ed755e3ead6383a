"""The main thread's one wait: a selector over every fd that can wake it, timers, and what runs each turn.

Like gunicorn's arbiter: what the reactor calls (a reader's handler, a timer, the child's exit) only
records; the loop that called `run_once` looks at what was recorded and acts.  What wakes a turn:

- the signal pipe (signals.SignalRecorder): drained here; `stop_signalled` is the one answer to "was a
  stop requested?", each new signal logged once;
- the child's pipes (child/output.py registers them) and the wake-ups of the health prober and the
  liveness threads (they write the same signal pipe: `wake`);
- the child's exit, through a pidfd (`watch_exit`): noticed at once, not at the next look;
- timers (`call_later`, `call_at`): the select timeout is the nearest of the caller's and theirs.

After every turn the turn hooks run (the output's sink flush and summaries, the operator view's tick).
`clock` is the Clock view of it for the waits that take a Clock (the GPU wait, the holder wait, the
reaper, a follower between runs): its sleep runs turns and raises StopRequested on a stop signal.
`steady_clock` runs the same turns but never raises: the stop path's GPU confirmation finishes even
after a second signal.
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import signal
import time
from collections.abc import Callable
from typing import Protocol

from kimi_supervisor.lifecycle.signals import STOP_SIGNALS, Signals, StopRequested, signal_name
from kimi_supervisor.logs.types import Logger

# Without a pidfd (Linux < 5.3, or a sandbox that refuses pidfd_open): how often the child's exit is polled.
EXIT_POLL_S = 0.1


class ExitSource(Protocol):
    """A child whose exit can be watched: `exit_fd` readable once it exited (a pidfd), else polled."""

    pid: int
    exit_fd: int | None
    exit_fd_error: str | None  # why there is no exit_fd

    def poll(self) -> int | None: ...


class TimerHandle:
    """A pending `call_later`/`call_at`; `cancel` before it is due and it never runs."""

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when = when
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    """Owns the main thread's selector (`Deps.selector()`), its timers and its turn hooks."""

    def __init__(
        self,
        signals: Signals,
        log: Logger,
        selector: selectors.BaseSelector,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signals = signals
        self.log = log
        self._selector = selector
        self._now = now
        self._readers: dict[int, Callable[[], None]] = {}
        self._timers: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._hooks: list[Callable[[], None]] = []
        self._exit_watches: dict[int, tuple[int | None, TimerHandle | None]] = {}
        self._exit_poll_logged = False
        self.add_reader(signals.read_fd, signals.clear_wakeups)
        self.clock = ReactorClock(self, interruptible=True)
        self.steady_clock = ReactorClock(self, interruptible=False)

    def monotonic(self) -> float:
        return self._now()

    # -- what wakes a turn ----------------------------------------------------------------

    def add_reader(self, fd: int, handler: Callable[[], None]) -> None:
        if fd in self._selector.get_map():
            # The same number, reused after its old file was closed while still registered: the new file wins.
            self._selector.unregister(fd)
        self._selector.register(fd, selectors.EVENT_READ)
        self._readers[fd] = handler

    def remove_reader(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            self._selector.unregister(fd)  # a closed fd too: the selector forgets it without asking the kernel

    def call_at(self, when: float, fn: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(when, fn)
        heapq.heappush(self._timers, (when, next(self._seq), handle))
        return handle

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        return self.call_at(self._now() + max(0.0, delay), fn)

    def add_turn_hook(self, fn: Callable[[], None]) -> None:
        self._hooks.append(fn)

    def remove_turn_hook(self, fn: Callable[[], None]) -> None:
        if fn in self._hooks:
            self._hooks.remove(fn)

    def wake(self) -> None:
        """From any thread: end the current or the next turn's wait (the signal pipe, so O(1) and async-safe)."""
        self.signals.wake()

    def watch_exit(self, child: ExitSource, fn: Callable[[], None]) -> None:
        """`fn` once, on the turn `child` exits: its pidfd becomes readable then; without one, polled."""
        fd = child.exit_fd
        if fd is not None:

            def exited() -> None:
                self.unwatch_exit(child)
                fn()

            self.add_reader(fd, exited)
            self._exit_watches[child.pid] = (fd, None)
            return
        if not self._exit_poll_logged:
            self._exit_poll_logged = True
            self.log.warning(
                "reactor.exit_polled",
                why=child.exit_fd_error or "no pidfd",
                poll_s=EXIT_POLL_S,
                effect=f"the child's exit is noticed within {EXIT_POLL_S:g}s, not at once",
            )

        def poll() -> None:
            if child.poll() is not None:
                self._exit_watches.pop(child.pid, None)
                fn()
            else:
                self._exit_watches[child.pid] = (None, self.call_later(EXIT_POLL_S, poll))

        self._exit_watches[child.pid] = (None, self.call_later(EXIT_POLL_S, poll))

    def unwatch_exit(self, child: ExitSource) -> None:
        fd, timer = self._exit_watches.pop(child.pid, (None, None))
        if fd is not None:
            self.remove_reader(fd)
        if timer is not None:
            timer.cancel()

    # -- one turn -------------------------------------------------------------------------

    def run_once(self, timeout: float) -> int:
        """Wait up to `timeout` (less when a timer is due sooner) for what wakes a turn; run its handlers,
        the timers due, then the turn hooks.  Returns how many handlers and timers ran."""
        timeout = max(0.0, timeout)
        due = self._next_timer()
        if due is not None:
            timeout = min(timeout, max(0.0, due - self._now()))
        ran = 0
        for key, _ in self._selector.select(timeout):
            handler = self._readers.get(key.fd)  # an earlier handler of this turn may have removed it
            if handler is not None:
                handler()
                ran += 1
        now = self._now()
        while self._timers and self._timers[0][0] <= now:
            handle = heapq.heappop(self._timers)[2]
            if not handle.cancelled:
                handle.fn()
                ran += 1
        for hook in list(self._hooks):
            hook()
        return ran

    def _next_timer(self) -> float | None:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    # -- was a stop requested? ------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """A stop signal arrived, whoever looked at it since."""
        return self.signals.stop_requested

    def stop_signalled(self, state: str, *, sticky: bool = False) -> bool:
        """Was a stop requested?  The one answer: each signal that arrived since the last look is logged (a stop
        signal received, any other ignored), and True when one of them asks to stop.  `sticky`: also True when
        a stop signal arrived before, whoever looked at it then (a follower between its runs)."""
        fresh = self.signals.new_signals()
        for sig, count in fresh.items():
            if sig in STOP_SIGNALS:
                self.log.info("signal.received", signal=signal_name(sig), state=state, count=count)
            else:
                why = "reload is not supported; restart the unit" if sig == signal.SIGHUP else "not a stop request"
                self.log.warning("signal.ignored", signal=signal_name(sig), count=count, why=why)
        return any(s in STOP_SIGNALS for s in fresh) or (sticky and self.signals.stop_requested)


class ReactorClock:
    """A Clock whose sleep runs the reactor's turns until the time passed; `interruptible`: raises
    StopRequested once a stop signal arrived (before the sleep or during it)."""

    def __init__(self, reactor: Reactor, interruptible: bool) -> None:
        self._reactor = reactor
        self._interruptible = interruptible

    def monotonic(self) -> float:
        return self._reactor.monotonic()

    def sleep(self, seconds: float) -> None:
        end = self._reactor.monotonic() + max(0.0, seconds)
        while True:
            self._check()
            self._reactor.run_once(end - self._reactor.monotonic())
            self._check()
            if self._reactor.monotonic() >= end:
                return

    def _check(self) -> None:
        if self._interruptible and self._reactor.stop_requested:
            raise StopRequested
