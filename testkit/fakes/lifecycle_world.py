"""One supervisor run with every boundary faked (testkit/fakes/lifecycle.py), and the lines vLLM's script says.

The tests in test_lifecycle*.py build a `World`, script what vLLM prints, what /health answers and which
signals arrive at which fake second, then `run()` it and read the log, the notify datagrams and the signals
the fake tree got.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config, SpawnSpec
from kimi_supervisor.exitcodes import SupervisorError
from kimi_supervisor.host.proctable import ProcInfo
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.drain import Drain, Reading
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.liveness.http import HttpClient
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd.notify import Notifier
from testkit.fakes.clock import T0, FakeClock
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.lifecycle import (
    FakeChild,
    FakeDrainSampler,
    FakeLiveness,
    FakeMetricsHttp,
    FakeProber,
    FakeProcessTable,
    FakeSelector,
    FakeSignals,
    ListSink,
    RecordingNotifier,
    TimedLog,
)
from testkit.harness import own_dirs

LOADING = "(Worker_TP0 pid=3) INFO 11-29 16:40:03 [gpu_model_runner.py:1] Starting to load model /models/m..."
STARTED = "(APIServer pid=1) INFO 11-29 16:49:20 [api_server.py:1] Starting vLLM API server 0 on http://0.0.0.0:8000"
# A real vLLM 0.32 fatal record (tests/fixtures/vllm_cpu_0.32/worker_killed.log): the file that logs it, then
# its message.
FATAL = (
    "(EngineCore_DP0 pid=2) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
    "unexpectedly (exit code: -9), shutting down executor."
)
HEALTH_LINE = '(APIServer pid=1) INFO:     127.0.0.1:40000 - "GET /health HTTP/1.1" 200 OK'
TICK = 0.06  # the loop's reaction time in fake seconds: a burst probe (0.02) or a stop-loop pump (0.05)


def lifecycle_config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    """The harness's real-process config, minus what only touches the host (GPUs, shm, the port)."""
    raw: dict[str, dict[str, Any]] = {
        "child": {"argv": ["vllm", "serve", "/models/m", "--port", "8000"]},
        "preflight": {"gpus": [], "check_model": False, "check_port": False},
        "preflight.shm": {"enabled": False},
        "readiness": {"stall_timeout_s": 20, "deadline_s": 60, "poll_interval_s": 0.1},
        "health": {"interval_s": 0.3, "timeout_s": 1, "failures_tolerated": 3},
        "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
        # The state file and the history too: never the host's /run or /var/lib.
        "paths": own_dirs(tmp_path),
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

    def __init__(
        self,
        cfg: Config,
        *,
        watchdog_s: float | None = None,
        term_exit_after: float | None = 0.2,
        sink: ListSink | None = None,
        probe: FakeGpuProbe | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = FakeClock()
        self.signals = FakeSignals()
        self.log = TimedLog(self.clock)
        self.notes = RecordingNotifier(self.clock)
        self.sink = sink if sink is not None else ListSink()
        self.liveness = FakeLiveness()
        self.health: Callable[[float], int | None] = lambda t: None
        # vLLM's /metrics: requests running at fake second t (None: refused); the drain reads it while stopping.
        self.in_flight: Callable[[float], float | None] = lambda t: 0.0
        self.http = FakeMetricsHttp(self.clock, lambda t: self.in_flight(t))
        self.table = FakeProcessTable()
        self.drain: Drain | None = None
        self.drain_sampler: FakeDrainSampler | None = None
        self.term_exit_after = term_exit_after
        self.script: Callable[[FakeChild], None] = lambda child: None
        self.child: FakeChild | None = None
        self.prober: FakeProber | None = None
        self.error: SupervisorError | None = None
        self.dumped: list[tuple[float, int]] = []  # (fake time, pid) of each stack dump: never a real py-spy here
        self.supervisor = Supervisor(
            cfg,
            Deps(
                probe=probe if probe is not None else FakeGpuProbe([]),
                table=self.table,
                notifier=self.notes,
                log=self.log,
                sink=self.sink,
                watchdog_s=watchdog_s,
                environ={},
                signals=self.signals,
                clock=self.clock,
                spawn=self,
                prober=self._prober,
                liveness=lambda given: self.liveness,
                selector=lambda: FakeSelector(self.clock),
                drain=self._drain,
                http=self.http,
                wall=self.clock.time,
                dumper=lambda: (self, "the fake world's dumper"),
            ),
        )

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]:
        self.dumped.append((self.clock.t, pid))
        return f'Thread {pid} (idle): "MainThread"\n    busy_loop (vllm/v1/engine/core.py:700)\n', None

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> None:
        return None

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: object) -> FakeChild:
        child = self.child = FakeChild(self.clock, self.term_exit_after)
        info = ProcInfo(child.pid, os.getpid(), "vllm", tuple(spec.argv), os.getuid(), child.pid, T0)
        self.table.add(info, lambda: child.returncode is None)
        self.script(child)
        return child

    def _drain(
        self,
        health_url: str,
        timeout_s: int,
        notifier: Notifier,
        log: Logger,
        *,
        http: HttpClient,
        clock: Callable[[], float],
    ) -> Drain:
        """The real Drain, with the supervisor's own HTTP client and clock; its sampler runs on the fake clock."""
        self.drain = Drain(health_url, timeout_s, notifier, log, http=http, clock=clock, sampler=self._sampler)
        return self.drain

    def _sampler(self, read: Callable[[], Reading]) -> FakeDrainSampler:
        self.drain_sampler = FakeDrainSampler(self.clock, read)
        return self.drain_sampler

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


def serving_world(tmp_path: Path, started_at: float = 1.0, **kw: Any) -> World:
    """vLLM that loads, says it started at `started_at`, and answers 200 from then on.

    `kw`: config sections (as `lifecycle_config` takes them) and `World`'s own keywords.
    """
    own = ("watchdog_s", "term_exit_after", "sink", "probe")
    sections = {k: v for k, v in kw.items() if k not in own}
    w = World(lifecycle_config(tmp_path, **sections), **{k: v for k, v in kw.items() if k in own})
    w.say_at(0.1, LOADING)
    w.say_at(started_at, STARTED)
    w.health = lambda t: 200 if t >= started_at else None
    return w


def ready_times(w: World) -> list[float]:
    return w.notes.times("READY", 1)
