"""Fakes for every boundary `Supervisor` has (kimi_supervisor/lifecycle/deps.py), on one event-driven fake clock.

testkit/fakes/lifecycle_world.py puts them together into one `World` around a real `Supervisor`.

The loop's waits go through `FakeSelector.select`, which advances the clock to the next scripted event (or
the whole timeout) and returns what became readable: real pipes carry the child's lines and the signal
wake-ups, so `ChildOutput`, the readiness tracker and the lifecycle run unpatched, in milliseconds.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import selectors
import signal
from collections.abc import Callable, Mapping
from typing import Any

from kimi_supervisor.child.process import read_pipe
from kimi_supervisor.lifecycle.signals import SignalRecorder
from kimi_supervisor.liveness.health_probe import HealthResult
from testkit.fakes.clock import RecordingLog

T0 = 1000.0
HORIZON_S = 100_000.0  # a loop that never ends fails the test instead of spinning forever


class EventClock:
    """Fake monotonic time; actions scheduled at times since the start run when the clock reaches them."""

    def __init__(self) -> None:
        self.now = T0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    @property
    def t(self) -> float:
        """Seconds since the start."""
        return self.now - T0

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (T0 + t, next(self._seq), action))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        self.at(self.t + seconds, action)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        end = self.now + max(0.0, seconds)
        while self._events and self._events[0][0] <= end:
            self.wait(end - self.now)
        self.now = end

    def wait(self, timeout: float) -> None:
        """Advance to the next event (running every action due then) or by `timeout`, whichever is first."""
        end = self.now + max(0.0, timeout)
        if self._events and self._events[0][0] <= end:
            end = max(self.now, self._events[0][0])
        self.now = end
        if self.now - T0 > HORIZON_S:
            raise AssertionError(f"the fake clock ran past {HORIZON_S:g}s: the loop never ended")
        while self._events and self._events[0][0] <= self.now:
            heapq.heappop(self._events)[2]()


class TimedLog(RecordingLog):
    """RecordingLog that also notes when (seconds since the start) each record was made."""

    def __init__(self, clock: EventClock) -> None:
        super().__init__()
        self._clock = clock
        self.times: list[float] = []

    def _log(self, level: str) -> Callable[..., None]:
        emit = super()._log(level)

        def timed(event: str, **fields: object) -> None:
            self.times.append(self._clock.t)
            emit(event, **fields)

        return timed

    def when(self, name: str) -> list[float]:
        return [t for t, (_, e, _) in zip(self.times, self.records, strict=True) if e == name]


class FakeSelector(selectors.BaseSelector):
    """A real selector over real fds, whose waiting is done by the fake clock."""

    def __init__(self, clock: EventClock) -> None:
        self._inner = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if not ready and timeout:
            self._clock.wait(timeout)
            ready = self._inner.select(0)
        return ready

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class FakeSignals(SignalRecorder):
    """The real recorder and wake-up pipe, without touching the test process's signal handlers."""

    installed = False

    def install(self) -> None:
        self.installed = True

    def uninstall(self) -> None:
        self.installed = False

    def send(self, sig: int) -> None:
        self._record(sig, None)


class FakeChild:
    """vLLM as a script: lines written to real pipes, an exit status, and how it answers signals."""

    def __init__(self, clock: EventClock, term_exit_after: float | None) -> None:
        self._clock = clock
        self.pid = 4242
        self.returncode: int | None = None
        self.term_exit_after = term_exit_after  # None: ignores SIGTERM
        self.signals: list[tuple[float, signal.Signals]] = []
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.streams = {"stdout": out_r, "stderr": err_r}
        self._writers: dict[str, int] = {"stdout": out_w, "stderr": err_w}

    def say(self, line: str, stream: str = "stdout") -> None:
        if stream in self._writers:
            os.write(self._writers[stream], (line + "\n").encode())

    def exit(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            for fd in self._writers.values():
                os.close(fd)
            self._writers.clear()

    def read(self, fd: int) -> bytes | None:
        return read_pipe(fd)  # real pipes: the fake stands in for the process, not for reading its output

    def poll(self) -> int | None:
        return self.returncode

    def refresh_members(self) -> list[FakeChild]:
        return self.alive_members()

    def alive_members(self) -> list[FakeChild]:
        return [self] if self.returncode is None else []

    def signal_tree(self, sig: signal.Signals) -> int:
        self.signals.append((self._clock.t, sig))
        if self.returncode is not None:
            return 0
        if sig == signal.SIGKILL:
            self.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and self.term_exit_after is not None:
            self._clock.after(self.term_exit_after, lambda: self.exit(-signal.SIGTERM))
        return 1

    def reap(self) -> None:
        return None

    def close(self) -> None:
        for fd in (*self.streams.values(), *self._writers.values()):
            with contextlib.suppress(OSError):
                os.close(fd)


class FakeProber:
    """/health answers `respond(t)` (a status, None: refused), probed on the real prober's schedule."""

    def __init__(
        self, clock: EventClock, respond: Callable[[float], int | None], interval_s: float, wake: Callable[[], None]
    ) -> None:
        self._clock = clock
        self._respond = respond
        self._interval = interval_s
        self._wake = wake
        self._burst_interval = interval_s
        self._burst_until = 0.0
        self._generation = 0
        self._stopped = False
        self._results: list[HealthResult] = []
        self.probes: list[float] = []

    def start(self) -> None:
        self._schedule(0.0)

    def stop(self) -> None:
        self._stopped = True

    def set_interval(self, interval_s: float) -> None:
        self._interval = interval_s
        self._burst_until = 0.0
        self._schedule(0.0)

    def burst(self, interval_s: float, for_s: float) -> None:
        self._burst_interval = interval_s
        self._burst_until = self._clock.now + for_s
        self._schedule(0.0)

    def drain(self) -> list[HealthResult]:
        out, self._results = self._results, []
        return out

    def _schedule(self, delay: float) -> None:
        # Like the real prober's Event: a new schedule replaces the pending wait.
        self._generation += 1
        generation = self._generation
        self._clock.after(delay, lambda: self._probe(generation))

    def _probe(self, generation: int) -> None:
        if self._stopped or generation != self._generation:
            return
        status = self._respond(self._clock.t)
        self.probes.append(self._clock.t)
        ok = status == 200
        error = None if ok else (f"HTTP {status}" if status is not None else "connection refused")
        self._results.append(HealthResult(ok=ok, status=status, error=error, at=self._clock.now, latency_s=0.0))
        self._wake()
        bursting = self._clock.now < self._burst_until
        self._schedule(self._burst_interval if bursting else self._interval)


class FakeLiveness:
    """No canary, no metrics, no GPU events: `healthy` and `check` as a test sets them."""

    def __init__(self) -> None:
        self.healthy = True
        self.started = self.stopped = self.closed = False

    def start(self) -> None:
        self.started = True

    def check(self) -> None:
        return None

    def in_flight_sample(self) -> tuple[float, float] | None:
        return None

    def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
        self.closed = True


class SilentNotifier:
    """A notifier for tests that assert on the log, not on the datagrams."""

    def send(self, **fields: str | int) -> None:
        return None


class RecordingNotifier:
    def __init__(self, clock: EventClock) -> None:
        self._clock = clock
        self.sent: list[tuple[float, dict[str, str | int]]] = []

    def send(self, **fields: str | int) -> None:
        self.sent.append((self._clock.t, fields))

    def times(self, key: str, value: str | int | None = None) -> list[float]:
        return [t for t, f in self.sent if key in f and (value is None or f[key] == value)]


class ListSink:
    name = "list"
    metered = False
    pending = 0

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        return None

    def take_dropped(self, final: bool = False) -> int:
        return 0

    def close(self, timeout_s: float) -> None:
        return None


class RaisingSink(ListSink):
    """Raises `exc` once, on the `nth` child line containing `marker` (by default the third /health access line)."""

    def __init__(self, exc: BaseException, marker: str = '"GET /health', nth: int = 3) -> None:
        super().__init__()
        self.exc: BaseException | None = exc
        self.marker, self.nth = marker, nth
        self.seen = 0

    def line(self, text: str, priority: int, fields: Mapping[str, str]) -> None:
        super().line(text, priority, fields)
        if self.marker in text:
            self.seen += 1
            if self.seen == self.nth and self.exc is not None:
                exc, self.exc = self.exc, None
                raise exc
