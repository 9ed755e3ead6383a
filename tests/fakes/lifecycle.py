"""Fakes for every boundary `Supervisor` has (kimi_supervisor/boundaries.py), on one event-driven fake clock.

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
from pathlib import Path
from typing import Any

from kimi_supervisor.child import read_pipe
from kimi_supervisor.config import parse_config
from kimi_supervisor.configtypes import Config, SpawnSpec
from kimi_supervisor.exitcodes import SupervisorError
from kimi_supervisor.health import HealthResult
from kimi_supervisor.proctable import PsutilProcessTable
from kimi_supervisor.signals import SignalRecorder
from kimi_supervisor.supervisor import Deps, Supervisor
from tests.fakes.clock import RecordingLog
from tests.fakes.gpu import FakeGpuProbe

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

    def install(self) -> None:
        return None

    def uninstall(self) -> None:
        return None

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
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def check(self) -> None:
        return None

    def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
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


def lifecycle_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """The harness's real-process config, minus what only touches the host (GPUs, shm, the port)."""
    raw: dict[str, dict[str, Any]] = {
        "child": {"argv": ["vllm", "serve", "/models/m", "--port", "8000"]},
        "preflight": {"gpus": [], "check_model": False, "check_port": False},
        "preflight.shm": {"enabled": False},
        "readiness": {"stall_timeout_s": 20, "deadline_s": 60, "poll_interval_s": 0.1},
        "health": {"interval_s": 0.3, "timeout_s": 1, "failures_tolerated": 3},
        "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
        "paths": {"runtime_directory": str(tmp_path / "run")},
    }
    for key, value in sections.items():
        raw.setdefault(key.replace("__", "."), {}).update(value)
    nested: dict[str, Any] = {}
    for dotted, table in raw.items():
        node = nested
        for part in dotted.split("."):
            node = node.setdefault(part, {})
        node.update(table)
    return parse_config(nested, tmp_path / "kimi.toml")


class World:
    """One supervisor run with every boundary faked; `run()` returns the exit code it would give cli.main."""

    def __init__(self, cfg: Config, *, watchdog_s: float | None = None, term_exit_after: float | None = 0.2) -> None:
        self.cfg = cfg
        self.clock = EventClock()
        self.signals = FakeSignals()
        self.log = TimedLog(self.clock)
        self.notes = RecordingNotifier(self.clock)
        self.sink = ListSink()
        self.liveness = FakeLiveness()
        self.health: Callable[[float], int | None] = lambda t: None
        self.term_exit_after = term_exit_after
        self.script: Callable[[FakeChild], None] = lambda child: None
        self.child: FakeChild | None = None
        self.prober: FakeProber | None = None
        self.error: SupervisorError | None = None
        self.supervisor = Supervisor(
            cfg,
            Deps(
                probe=FakeGpuProbe([]),
                table=PsutilProcessTable(),
                notifier=self.notes,
                log=self.log,
                sink=self.sink,
                watchdog_s=watchdog_s,
                environ={},
                signals=self.signals,
                clock=self.clock,
                spawn=self,
                prober=self._prober,
                liveness=lambda *args, **kw: self.liveness,
                selector=lambda: FakeSelector(self.clock),
                drain=lambda *args: None,  # the drain talks to a real /metrics: stop the tree at once
            ),
        )

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> None:
        return None

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: object) -> FakeChild:
        self.child = FakeChild(self.clock, self.term_exit_after)
        self.script(self.child)
        return self.child

    def _prober(self, url: str, timeout_s: float, interval_s: float, wake: Callable[[], None]) -> FakeProber:
        self.prober = FakeProber(self.clock, lambda t: self.health(t), interval_s, wake)
        return self.prober

    def say_at(self, t: float, line: str) -> None:
        self.clock.at(t, lambda: self.child.say(line) if self.child else None)

    def signal_at(self, t: float, sig: int = signal.SIGTERM) -> None:
        self.clock.at(t, lambda: self.signals.send(sig))

    def run(self) -> int:
        try:
            return int(self.supervisor.run())
        except SupervisorError as err:
            self.error = err
            return int(err.exit_code)
        finally:
            if self.child is not None:
                self.child.close()
            for fd in (self.signals.read_fd, self.signals._write_fd):
                os.close(fd)

    def events(self, name: str) -> list[dict[str, object]]:
        return self.log.events(name)

    def names(self) -> list[str]:
        return [e for _, e, _ in self.log.records]
