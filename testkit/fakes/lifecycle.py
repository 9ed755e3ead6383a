"""Fakes for every boundary `Supervisor` has (kimi_supervisor/lifecycle/deps.py), on one event-driven fake clock.

testkit/fakes/lifecycle_world.py puts them together into one `World` around a real `Supervisor`.

The loop's waits (the reactor's turns) go through `FakeSelector.select`, which advances the clock to the next
scripted event (or the whole timeout) and returns what became readable: real pipes carry the child's lines,
the signal wake-ups and the child's exit (a pipe standing in for the pidfd), so `ChildOutput`, the readiness
tracker and the lifecycle run unpatched, in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
from collections.abc import Callable, Mapping
from typing import Any

from kimi_supervisor.child.process import read_pipe
from kimi_supervisor.host.procfiles import OpenPaths
from kimi_supervisor.host.procstate import ProcState
from kimi_supervisor.host.proctable import ProcInfo
from kimi_supervisor.lifecycle.drain import POLL_S, Reading
from kimi_supervisor.lifecycle.signals import SignalRecorder
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.liveness.http import MAX_BODY, Answer
from testkit.fakes.clock import T0, FakeClock
from testkit.fakes.log import RecordingLog


class TimedLog(RecordingLog):
    """RecordingLog that also notes when (seconds since the start) each record was made."""

    def __init__(self, clock: FakeClock) -> None:
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

    def __init__(self, clock: FakeClock) -> None:
        self._inner = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """Like a real select: returns once something is readable or the timeout passed, not at every event
        of the script (an exit nobody watches must not end the wait)."""
        ready = self._inner.select(0)
        end = self._clock.now + (timeout or 0.0)
        while not ready and self._clock.now < end:
            self._clock.wait(end - self._clock.now)
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
    """vLLM as a script: lines written to real pipes, a return code, and how it answers signals."""

    def __init__(self, clock: FakeClock, term_exit_after: float | None) -> None:
        self._clock = clock
        self.pid = 4242
        self.returncode: int | None = None
        self.term_exit_after = term_exit_after  # None: ignores SIGTERM
        self.survives_sigkill = False  # stuck in the kernel (D state): SIGKILL stays pending
        self.signals: list[tuple[float, signal.Signals]] = []
        self.main_signals: list[tuple[float, signal.Signals]] = []  # to the main alone (the drain's SIGTERM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        self.streams = {"stdout": out_r, "stderr": err_r}
        self._writers: dict[str, int] = {"stdout": out_w, "stderr": err_w}
        # The pidfd's stand-in: readable (end of file) from the fake instant of the exit on.
        self.exit_fd: int | None
        self.exit_fd, self._exit_w = os.pipe()
        self.exit_fd_error: str | None = None

    def say(self, line: str, stream: str = "stdout") -> None:
        if stream in self._writers:
            os.write(self._writers[stream], (line + "\n").encode())

    def exit(self, returncode: int, *, pipes_held: bool = False) -> None:
        """`pipes_held`: a worker that outlives vLLM's main keeps its stdout and stderr open (no end of file)."""
        if self.returncode is None:
            self.returncode = returncode
            if not pipes_held:
                for fd in self._writers.values():
                    os.close(fd)
                self._writers.clear()
            os.close(self._exit_w)
            self._exit_w = -1

    def read(self, fd: int) -> bytes | None:
        return read_pipe(fd)  # real pipes: the fake stands in for the process, not for reading its output

    def poll(self) -> int | None:
        return self.returncode

    def refresh_members(self) -> list[FakeChild]:
        return self.alive_members()

    def alive_members(self) -> list[FakeChild]:
        return [self] if self.returncode is None else []

    def create_time(self) -> float:
        return T0  # as the fake world's process table lists it (lifecycle_world.py)

    def signal_tree(self, sig: signal.Signals) -> int:
        if self.returncode is not None:
            return 0  # no member left to get it (the drain's SIGTERM for stragglers, once the main exited)
        self.signals.append((self._clock.t, sig))
        if sig == signal.SIGKILL and not self.survives_sigkill:
            self.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and self.term_exit_after is not None:
            self._clock.after(self.term_exit_after, lambda: self.exit(-signal.SIGTERM))
        return 1

    def signal_main(self, sig: signal.Signals) -> None:
        self.main_signals.append((self._clock.t, sig))
        self.signal_tree(sig)  # the fake main is all of the fake tree

    def reap(self) -> None:
        return None

    def close(self) -> None:
        for fd in (*self.streams.values(), *self._writers.values(), self.exit_fd, self._exit_w):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class FakeProber:
    """/health answers `respond(t)` (an HTTP status code, None: refused), probed on the real prober's schedule."""

    def __init__(
        self, clock: FakeClock, respond: Callable[[float], int | None], interval_s: float, wake: Callable[[], None]
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

    def new_results(self) -> list[HealthResult]:
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
        http_status = self._respond(self._clock.t)
        self.probes.append(self._clock.t)
        ok = http_status == 200
        error = None if ok else (f"HTTP {http_status}" if http_status is not None else "connection refused")
        self._results.append(
            HealthResult(ok=ok, http_status=http_status, error=error, at=self._clock.now, latency_s=0.0)
        )
        self._wake()
        bursting = self._clock.now < self._burst_until
        self._schedule(self._burst_interval if bursting else self._interval)


class FakeDrainSampler:
    """The drain's sampler on the fake clock: the real reading (`Drain._read`) every POLL_S, from `start`."""

    def __init__(self, clock: FakeClock, read: Callable[[], Reading]) -> None:
        self._clock = clock
        self._read = read
        self._stopped = False
        self.latest: Reading | None = None
        self.readings: list[float] = []  # when (seconds since the start) each reading was taken

    def start(self) -> None:
        self._clock.after(0.0, self._sample)

    def stop(self) -> None:
        self._stopped = True

    def _sample(self) -> None:
        if self._stopped:
            return
        self.latest = self._read()
        self.readings.append(self._clock.t)
        self._clock.after(POLL_S, self._sample)


class FakeProcessTable:
    """The fake world's process table: the fake vLLM and what a test adds under it, nothing of the host's."""

    def __init__(self) -> None:
        self._procs: dict[int, tuple[ProcInfo, Callable[[], bool]]] = {}
        self.states: dict[int, ProcState] = {}  # what /proc would say of a process stuck in the kernel

    def add(self, info: ProcInfo, alive: Callable[[], bool]) -> None:
        self._procs[info.pid] = (info, alive)

    def get(self, pid: int) -> ProcInfo | None:
        entry = self._procs.get(pid)
        return entry[0] if entry is not None and entry[1]() else None

    def all(self) -> list[ProcInfo]:
        return [info for info, alive in self._procs.values() if alive()]

    def descendants(self, pid: int) -> list[ProcInfo]:
        found, parents = [], {pid}
        for info in sorted(self.all(), key=lambda i: i.pid):
            if info.ppid in parents:
                found.append(info)
                parents.add(info.pid)
        return found

    def open_paths(self, prefixes: tuple[str, ...]) -> OpenPaths:
        return OpenPaths()

    def alive(self, proc: ProcInfo) -> bool:
        return self.get(proc.pid) == proc

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool:
        raise AssertionError(f"the fake world signals its child through FakeChild, not pid {proc.pid}")

    def cgroup(self, pid: int) -> str | None:
        return None

    def state(self, pid: int) -> ProcState | None:
        return self.states.get(pid)


class FakeMetricsHttp:
    """vLLM's /metrics as an HttpClient: `in_flight(t)` requests running (None: connection refused)."""

    def __init__(self, clock: FakeClock, in_flight: Callable[[float], float | None]) -> None:
        self._clock = clock
        self._in_flight = in_flight
        self.requests: list[tuple[float, str, float]] = []  # (t, url, timeout_s)

    def __call__(
        self,
        method: str,
        url: str,
        timeout_s: float,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_body: int = MAX_BODY,
    ) -> Answer:
        self.requests.append((self._clock.t, url, timeout_s))
        if not url.endswith("/metrics"):
            raise AssertionError(f"the fake world answers /metrics only, not {method} {url}")
        count = self._in_flight(self._clock.t)
        if count is None:
            return Answer(None, b"", "connection refused", self._clock.now, 0.0)
        page = f"vllm:num_requests_running {count}\nvllm:num_requests_waiting 0.0\n".encode()
        return Answer(200, page, None, self._clock.now, 0.0)


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
    def __init__(self, clock: FakeClock) -> None:
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
