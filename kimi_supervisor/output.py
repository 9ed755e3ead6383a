"""The child's output, end to end: read -> split -> redact -> classify -> track -> meter -> sink.

One object owns the pipes, the selector the loop waits on, and every step a line goes through:

- read: non-blocking pipes, at most `SLICE_S` of work per wake-up, so a flooding child cannot starve
  signals, health results or the watchdog;
- split (child.LineSplitter), redact known secrets, classify (childlog: record, access line, traceback);
- track (readiness.ReadinessTracker): every line, whatever happens to it later, so a fatal line is
  never missed because its journal copy was suppressed;
- meter (LineMeter): only toward journald, which rate-limits per unit: at most `CHILD_LINES_PER_S` child
  lines a second per journald priority pool, the rest counted and reported once a second
  ("child.suppressed lines=N"), so the supervisor's own records always fit under the unit's
  LogRateLimitBurst;
- sink: never blocks; what a stalled reader could not take is dropped, counted, and reported once the
  sink flows again ("child.dropped lines=N").
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable

from kimi_supervisor.child.lines import LineClassifier
from kimi_supervisor.child.process import Child, LineSplitter
from kimi_supervisor.child.readiness import LineEvent, ReadinessTracker
from kimi_supervisor.clock import Clock
from kimi_supervisor.journal import ChildSink
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.redact import redact_text

SLICE_S = 0.05  # reading one wake-up's output stops after this long: the loop's other duties come first
# vLLM logs a few lines a second while serving (one access line per request, stats every 10 s) and a few
# hundred in a burst (startup routes, a traceback per process when it dies): 4000/s per priority is >10x
# that.  The unit's LogRateLimitIntervalSec=10s / LogRateLimitBurst=60000 leave room for 11 such
# seconds (44000) plus the supervisor's own records in every window (unit.py).
CHILD_LINES_PER_S = 4000
# journald keeps one rate-limit pool per priority group (journald-rate-limit.c: priority_map).
_POOL = {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 3, 6: 3, 7: 4}


class LineMeter:
    """At most `per_s` lines per second per journald priority pool; the rest are counted, not sent."""

    def __init__(self, per_s: int = CHILD_LINES_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self._clock = clock
        self._second = int(clock())
        self._used = [0] * 5
        self.suppressed = 0  # in seconds that are over, not yet reported
        self._suppressing = 0  # in the current second

    def admit(self, priority: int) -> bool:
        self._roll()
        pool = _POOL.get(priority, 3)
        if self._used[pool] < self.per_s:
            self._used[pool] += 1
            return True
        self._suppressing += 1
        return False

    def take_suppressed(self, final: bool = False) -> int:
        """Lines suppressed in seconds that have ended (a summary at most once a second); `final`: all."""
        self._roll()
        n, self.suppressed = self.suppressed, 0
        if final:
            n, self._suppressing = n + self._suppressing, 0
        return n

    def _roll(self) -> None:
        second = int(self._clock())
        if second != self._second:
            self._second = second
            self._used = [0] * 5
            self.suppressed += self._suppressing
            self._suppressing = 0


class ChildOutput:
    """Owns the selector: the child's pipes, plus wake-up fds (signals) whose handlers the owner gives."""

    def __init__(
        self,
        sink: ChildSink,
        tracker: ReadinessTracker,
        log: Logger,
        secrets: tuple[str, ...] = (),
        meter: LineMeter | None = None,
        clock: Clock | None = None,
        selector: selectors.BaseSelector | None = None,
    ) -> None:
        self.sink = sink
        self.tracker = tracker
        self.log = log
        self._secrets = secrets
        self._now = clock.monotonic if clock is not None else time.monotonic
        self.meter = meter if meter is not None else (LineMeter(clock=self._now) if sink.metered else None)
        self._selector = selector if selector is not None else selectors.DefaultSelector()
        self._wakeups: dict[int, Callable[[], None]] = {}
        self._child: Child | None = None
        self._splitters: dict[int, LineSplitter] = {}
        self._classifiers: dict[int, LineClassifier] = {}
        self.last_output = 0.0
        # Called with (now, event) for each line while someone listens (the supervisor while starting).
        self.on_line: Callable[[float, LineEvent], None] | None = None
        self.on_output: Callable[[float], None] | None = None

    def add_wakeup(self, fd: int, handler: Callable[[], None]) -> None:
        self._selector.register(fd, selectors.EVENT_READ, "wakeup")
        self._wakeups[fd] = handler

    def attach(self, child: Child) -> None:
        self._child = child
        self.last_output = self._now()
        for fd in child.streams.values():
            self._selector.register(fd, selectors.EVENT_READ, "child")
            self._splitters[fd] = LineSplitter(secrets=self._secrets)  # redacts before it cuts
            self._classifiers[fd] = LineClassifier(default_priority=6)

    @property
    def streams_open(self) -> bool:
        """Until both of the child's pipes reached end of file."""
        return any(key.data == "child" for key in self._selector.get_map().values())

    def pump(self, timeout: float) -> None:
        """Wait up to `timeout` for output or a wake-up; handle what came; never block on a sink."""
        if self.sink.pending:
            timeout = min(timeout, 0.05)  # a stalled sink is retried soon, not only when output comes
        for key, _ in self._selector.select(timeout):
            if key.data == "wakeup":
                self._wakeups[key.fd]()
            else:
                self._read(key.fd)
        self.sink.flush()
        self._report()

    def finish(self, timeout_s: float = 1.0) -> None:
        """After the tree is gone: partial last lines, the last summaries, and a bounded wait for the sink."""
        for fd, splitter in self._splitters.items():
            for line in splitter.close():
                self._on_line(fd, line, self._now())
        self.sink.flush()
        self.sink.close(timeout_s)
        self._report(final=True)

    def _read(self, fd: int) -> None:
        assert self._child is not None
        until = self._now() + SLICE_S
        while True:
            data = self._child.read(fd)
            if data is None:
                for line in self._splitters[fd].close():
                    self._on_line(fd, line, self._now())
                self._selector.unregister(fd)
                return
            if not data:
                return
            now = self._now()
            self.last_output = now
            for line in self._splitters[fd].feed(data):
                self._on_line(fd, line, now)
            if self.on_output is not None:
                self.on_output(now)
            if now >= until:
                return  # the rest waits in the pipe for the next wake-up

    def _on_line(self, fd: int, text: str, now: float) -> None:
        if self._secrets:
            text = redact_text(text, self._secrets)
        line = self._classifiers[fd].classify_line(text)
        event = self.tracker.feed(line)  # fatal lines matter after READY too
        if self.on_line is not None:
            self.on_line(now, event)
        if self.meter is not None and not self.meter.admit(line.priority):
            return
        self.sink.line(text, line.priority, line.fields)

    def _report(self, final: bool = False) -> None:
        if self.meter is not None:
            suppressed = self.meter.take_suppressed(final)
            if suppressed:
                self.log.warning("child.suppressed", lines=suppressed, budget_per_s=self.meter.per_s)
        dropped = self.sink.take_dropped(final)
        if dropped:
            self.log.warning("child.dropped", lines=dropped, sink=self.sink.name, why="the reader stalled")
