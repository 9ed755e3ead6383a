"""The child's output, end to end: read -> split -> redact -> classify -> track -> meter -> sink.

One object owns the pipes and every step a line goes through; the wait itself is the reactor's
(lifecycle/reactor.py, seen here as wakeups.Wakeups): the pipes are its readers, the sink's flush and the
summaries its turn hook.

- read: non-blocking pipes, at most `SLICE_S` of work per wake-up, so a flooding child cannot starve
  signals, health results or the watchdog;
- split (child.LineSplitter), redact known secrets, classify (childlog: record, access line, traceback);
- track (readiness.ReadinessTracker): every line that could matter to it, whatever happens to it later, so
  a fatal line is never missed because its journal copy was suppressed;
- meter (LineMeter): at most `CHILD_LINES_PER_S` child lines a second per journald priority pool, the
  rest counted and reported once a second ("child.suppressed lines=N"): toward journald so the
  supervisor's own records always fit under the unit's LogRateLimitBurst, toward stdout so that
  formatting a flood never costs the loop more than a few percent of a core;
- sink: never blocks; what a stalled reader could not take is dropped, counted, and reported once the
  sink flows again ("child.dropped lines=N").

A flood is read at memory speed (linescan): a block of whole lines is scanned in C for lines that are not
plain INFO records; plain lines the meter has no room for are only counted (and the tracker's tail kept),
never decoded, classified or encoded.  Everything else takes the full path above, line by line.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from kimi_supervisor.child.lines import LineClassifier
from kimi_supervisor.child.linescan import (
    bad_close,
    bad_start,
    has_long_line,
    last_lines_start,
    line_end_after,
    line_of,
    literal_scan,
)
from kimi_supervisor.child.process import Child, LineSplitter
from kimi_supervisor.child.readiness import LineEvent, ReadinessTracker
from kimi_supervisor.clock import Clock
from kimi_supervisor.logs.journal import ChildSink
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.redact import redact_text, secret_bytes
from kimi_supervisor.wakeups import Timer, Wakeups

SINK_RETRY_S = 0.05  # a stalled sink is retried this soon, not only when output comes
SLICE_S = 0.05  # reading one wake-up's output stops after this long: the loop's other duties come first
READ_REST_S = 1.0  # the most a stop spends reading what the pipes still hold once the tree is gone
# vLLM logs a few lines a second while serving (one access line per request, stats every 10 s) and a few
# hundred in a burst (startup routes, a traceback per process when it dies): 4000/s per priority is >10x
# that.  The unit's LogRateLimitIntervalSec=10s / LogRateLimitBurst=60000 leave room for 11 such
# seconds (44000) plus the supervisor's own records in every window (unit.py).  On stdout the same budget
# keeps a flood's formatting (2-8 µs a line in JSON) under 3% of a core.
CHILD_LINES_PER_S = 4000
PLAIN_PRIORITY = 6  # every plain line (linescan) is INFO: one journald pool
MAX_LINE = 16 * 1024  # the splitter's cut
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

    def room(self, priority: int) -> int:
        """How many more lines of `priority`'s pool this second admits."""
        self._roll()
        return max(0, self.per_s - self._used[_POOL.get(priority, 3)])

    def suppress(self, lines: int) -> None:
        """`lines` the caller did not offer one by one because `room` said none fits: counted the same."""
        self._roll()
        self._suppressing += lines

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
    """The child's pipes as the reactor's readers; the sink's flush and the summaries as its turn hook."""

    def __init__(
        self,
        sink: ChildSink,
        tracker: ReadinessTracker,
        log: Logger,
        secrets: tuple[str, ...] = (),
        meter: LineMeter | None = None,
        clock: Clock | None = None,
        *,
        reactor: Wakeups,
    ) -> None:
        self.sink = sink
        self.tracker = tracker
        self.log = log
        self._secrets = secrets
        self._now = clock.monotonic if clock is not None else time.monotonic
        self.meter = meter if meter is not None else (LineMeter(clock=self._now) if sink.metered else None)
        self._secret_bytes = secret_bytes(secrets)
        # Plain blocks the tracker was not shown (buffer, start, end): their last lines join its tail before
        # the next line reaches it or the wake-up ends, not on every read.
        self._unseen: list[tuple[bytes, int, int]] = []
        self._partials: dict[int, bytes] = {}
        self._held: set[int] = set()
        self._tail_splitter = LineSplitter(max_line=MAX_LINE)
        self._starting_scan = literal_scan(tracker.prefilter)
        self._reactor = reactor
        self._open: set[int] = set()  # the child's pipes not at end of file yet: the reactor's readers
        self._retry: Timer | None = None
        self._child: Child | None = None
        self._splitters: dict[int, LineSplitter] = {}
        self._classifiers: dict[int, LineClassifier] = {}
        self.last_output = 0.0
        # Called with (now, event) for each line while someone listens (the supervisor while starting).
        self.on_line: Callable[[float, LineEvent], None] | None = None
        self.on_output: Callable[[float], None] | None = None

    def attach(self, child: Child) -> None:
        self._child = child
        self.last_output = self._now()
        for fd in child.streams.values():
            self._reactor.add_reader(fd, functools.partial(self._readable, fd))
            self._open.add(fd)
            self._splitters[fd] = LineSplitter(max_line=MAX_LINE, secrets=self._secrets)  # redacts before it cuts
            self._classifiers[fd] = LineClassifier(default_priority=6)
        self._reactor.add_turn_hook(self._turn)

    @property
    def streams_open(self) -> bool:
        """Until both of the child's pipes reached end of file."""
        return bool(self._open)

    def _turn(self) -> None:
        """After every wake-up: never block on a sink; what it could not take is retried soon."""
        self.sink.flush()
        self._report()
        if self.sink.pending and self._retry is None:
            self._retry = self._reactor.call_later(SINK_RETRY_S, self._retried)

    def _retried(self) -> None:
        self._retry = None  # the turn it woke flushes, and schedules the next retry if still needed

    def finish(self, timeout_s: float = 1.0) -> None:
        """After the tree is gone: what its pipes still hold, partial last lines, the last summaries, and a
        bounded wait for the sink."""
        self._reactor.remove_turn_hook(self._turn)
        if self._retry is not None:
            self._retry.cancel()
        self._read_rest()
        for fd in self._splitters:
            self._close_stream(fd)
        for fd in self._open:  # a pipe a stray holder keeps open: not this run's to read any more
            self._reactor.remove_reader(fd)
        self._open.clear()
        self._show_unseen()
        # The last summaries before the sink's bounded wait: sent after it, they could sit in a stalled
        # journal's backlog when the process ends, and the count of lost lines would itself be lost.
        self._report(final=True)
        self.sink.flush()
        self.sink.close(timeout_s)
        # Lines the reader had not taken when the wait ended are given up: counted here, else lost silently.
        abandoned = self.sink.take_dropped(final=True)
        if abandoned:
            self.log.warning(
                "child.dropped",
                lines=abandoned,
                sink=self.sink.name,
                why=f"the reader took no more within {timeout_s:g}s of the exit",
            )

    def _read_rest(self) -> None:
        """The pipes to their end of file: a reader still behind a flood when the tree ended has up to a pipe's
        64 KiB left (seen: 371 lines neither shown nor counted).  Bounded by READ_REST_S: a pipe a stray holder
        keeps open and writing is not this run's to read for ever."""
        if self._child is None:
            return
        until = self._now() + READ_REST_S
        for fd in sorted(self._open):
            while fd in self._open and self._now() < until and self._read(fd):
                pass  # a slice's worth read, more may wait: read on, until end of file, empty, or the bound

    def _close_stream(self, fd: int) -> None:
        lines = self._splitters[fd].feed(self._partials.pop(fd, b""))
        self._lines(fd, lines + self._splitters[fd].close(), self._now())

    def _readable(self, fd: int) -> None:
        self._read(fd)

    def _read(self, fd: int) -> bool:
        """One wake-up's reading of `fd`; True when it stopped for its slice with more perhaps waiting."""
        assert self._child is not None
        until = self._now() + SLICE_S
        while True:
            data = self._child.read(fd)
            if data is None:
                self._close_stream(fd)
                self._reactor.remove_reader(fd)
                self._open.discard(fd)
                return False
            if not data:
                self._show_unseen()
                return False
            now = self._now()
            self.last_output = now
            self._feed(fd, data, now)
            if self.on_output is not None:
                self.on_output(now)
            if now >= until:
                self._show_unseen()
                return True  # the rest waits in the pipe for the next wake-up

    def _feed(self, fd: int, data: bytes, now: float) -> None:
        """The bytes just read: whole lines in bulk where that is safe (linescan), the rest line by line.

        A line begun in an earlier read waits in `_partials` (at most MAX_LINE bytes), or in the splitter
        once the full path had it (`_held`): the splitter then completes it.
        """
        splitter = self._splitters[fd]
        partial = self._partials.pop(fd, b"")
        if self.meter is None or not self._bulk_safe(data):  # unmetered: every line needs the full path anyway
            data = partial + data if partial else data
            self._lines(fd, splitter.feed(data), now)
            self._hold(fd, not data.endswith(b"\n"))
            return
        first = data.find(b"\n")
        if first < 0:
            self._keep_partial(fd, partial + data)
            return
        if fd in self._held:
            self._lines(fd, splitter.feed(data[: first + 1]), now)  # completes the line the splitter holds
            self._hold(fd, False)
        else:
            head = b"\n" + partial + data[: first + 1]  # a secret may span the two reads: checked again
            if self._bulk_safe(head):
                self._block(fd, head, 1, len(head), now)
            else:
                self._lines(fd, splitter.feed(head[1:]), now)
        last = data.rfind(b"\n")
        if last > first:
            self._block(fd, data, first + 1, last + 1, now)
        if last + 1 < len(data):
            self._keep_partial(fd, data[last + 1 :])

    def _bulk_safe(self, data: bytes) -> bool:
        # \r splits lines too (tqdm redraws): the splitter's business; a secret: redaction changes the text.
        return b"\r" not in data and not any(secret in data for secret in self._secret_bytes)

    def _keep_partial(self, fd: int, partial: bytes) -> None:
        if fd in self._held or len(partial) > MAX_LINE:  # a long line: the splitter cuts it, memory bounded
            self._lines(fd, self._splitters[fd].feed(partial), self._now())
            self._hold(fd, True)
        else:
            self._partials[fd] = partial

    def _hold(self, fd: int, held: bool) -> None:
        if held:
            self._held.add(fd)
        else:
            self._held.discard(fd)

    def _block(self, fd: int, data: bytes, start: int, end: int, now: float) -> None:
        """data[start:end]: whole lines (data[start - 1] is a \n); the splitter holds nothing."""
        splitter = self._splitters[fd]
        classifier = self._classifiers[fd]
        words = None if self.tracker.serving else self._starting_scan
        if (not self.tracker.serving and words is None) or has_long_line(data, start, end, MAX_LINE):
            self._lines(fd, splitter.feed(data[start:end]), now)
            return
        pos = start
        # Where the next line that is not plain starts, by each test; a test searches again only once
        # `pos` has passed what it found, so each byte is searched once by each (a block of such lines
        # costs one short search a line, not one over the rest of the block).
        next_start = next_words = -1
        while pos < end:
            if classifier.in_traceback:  # every line until the exception line belongs to it: one at a time
                nl = data.index(b"\n", pos, end) + 1
                self._lines(fd, splitter.feed(data[pos:nl]), now)
                pos = nl
                continue
            if next_start < pos:
                next_start = bad_start(data, pos, end)
            limit = next_start
            if words is not None:  # while starting: also any line with one of the tracker's words
                if next_words < pos:
                    next_words = line_of(words, data, pos, end)
                limit = min(limit, next_words)
            hit = bad_close(data, pos, limit)
            if hit > pos:
                self._plain(fd, data, pos, hit, now)
            if hit < end:
                nl = data.index(b"\n", hit, end) + 1
                self._lines(fd, splitter.feed(data[hit:nl]), now)
                pos = nl
            else:
                pos = end

    def _plain(self, fd: int, data: bytes, start: int, end: int, now: float) -> None:
        """Plain lines (linescan): those the meter admits go the full path, the rest are only counted."""
        assert self.meter is not None
        room = self.meter.room(PLAIN_PRIORITY)
        lines = data.count(b"\n", start, end)
        if room >= lines:
            self._lines(fd, self._splitters[fd].feed(data[start:end]), now)
            return
        if room:
            cut = line_end_after(data, start, end, room)
            self._lines(fd, self._splitters[fd].feed(data[start:cut]), now)
            start, lines = cut, lines - room
        self.meter.suppress(lines)
        self.tracker.skip(lines)
        keep = self.tracker.tail.maxlen or 0
        if lines >= keep:
            self._unseen = [(data, start, end)]  # its last lines are all the tail will hold
        else:
            self._unseen.append((data, start, end))
            if len(self._unseen) > keep:
                self._show_unseen()

    def _show_unseen(self) -> None:
        """The tracker's tail as if it had seen every line: the last lines of the blocks it was not shown."""
        unseen, self._unseen = self._unseen, []
        keep = self.tracker.tail.maxlen or 0
        for data, start, end in unseen:
            first = last_lines_start(data, start, end, keep)
            self.tracker.tail.extend(self._tail_splitter.feed(data[first:end]))

    def _lines(self, fd: int, lines: list[str], now: float) -> None:
        for line in lines:
            self._on_line(fd, line, now)

    def _on_line(self, fd: int, text: str, now: float) -> None:
        if self._unseen:
            self._show_unseen()
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
