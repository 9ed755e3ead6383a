"""What the lifecycle talks to, as small Protocols: `Supervisor` gets each through `Deps`.

`RolePart` is what the run asks its role (kimi_supervisor/deployment/ has one per role).  `Deps`' defaults are
the real ones (a spawned `ChildProcess`, a threaded `HealthProber`, `DeepLiveness`,
`drain.Drain`, a `DefaultSelector`, `liveness.http.request`, `time.time`); cli passes the `SignalRecorder`.
The one `Reactor` (reactor.py) is built here over `signals`, `selector()` and `clock`, unless given, and
shared by every `dataclasses.replace` of these Deps (a follower's runs).  The operator's view and the drain
get the same clock, process table and HTTP client as the rest.  testkit/fakes/lifecycle.py passes fakes and
drives the whole lifecycle, the drain included, on a fake clock in milliseconds, without patching anything.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from kimi_supervisor.child.process import Child, PreparedSpawn, ProcessSpawner
from kimi_supervisor.clock import Clock
from kimi_supervisor.config.model import Config, SpawnSpec
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.host.proctable import ProcessTable
from kimi_supervisor.lifecycle.drain import Drain
from kimi_supervisor.lifecycle.machine import StateMachine
from kimi_supervisor.lifecycle.reactor import Reactor
from kimi_supervisor.lifecycle.signals import SignalRecorder, Signals
from kimi_supervisor.lifecycle.threadwatch import ThreadWatch
from kimi_supervisor.liveness.engine import DeepLiveness, LivenessInputs
from kimi_supervisor.liveness.health_probe import HealthProber, HealthResult
from kimi_supervisor.liveness.http import HttpClient, request
from kimi_supervisor.logs.journal import ChildSink
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview.forensics import Dumper, default_dumper
from kimi_supervisor.systemd.notify import Notifier


class Spawner(Protocol):
    """Resolves user, groups and executable before the preflight acts (`prepare`), then spawns."""

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> PreparedSpawn | None: ...

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: PreparedSpawn | None) -> Child: ...


class Prober(Protocol):
    """Probes /health in the background; the loop takes its new results (liveness.health_probe.HealthProber)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def set_interval(self, interval_s: float) -> None: ...

    def burst(self, interval_s: float, for_s: float) -> None: ...

    def new_results(self) -> list[HealthResult]: ...


class ProberFactory(Protocol):
    def __call__(self, url: str, timeout_s: float, interval_s: float, wake: Callable[[], None]) -> Prober: ...


class Liveness(Protocol):
    """Canary, token progress and GPU events while serving (liveness.DeepLiveness)."""

    @property
    def healthy(self) -> bool: ...

    def start(self) -> None: ...

    def check(self) -> None: ...

    def in_flight_sample(self) -> tuple[float, float] | None: ...  # (monotonic, running + waiting) for the stop

    def stop(self) -> None: ...

    def close(self) -> None: ...


# Builds the Liveness once READY (liveness.engine.DeepLiveness), from one LivenessInputs.
LivenessFactory = Callable[[LivenessInputs], Liveness]


class DrainFactory(Protocol):
    """The graceful stop of a serving vLLM (drain.Drain): its health URL, vLLM's --shutdown-timeout, the notifier,
    the log, the HTTP client for its /metrics and the loop's monotonic clock; None: stop the tree at once."""

    def __call__(
        self,
        health_url: str,
        timeout_s: int,
        notifier: Notifier,
        log: Logger,
        /,
        *,
        http: HttpClient,
        clock: Callable[[], float],
    ) -> Drain | None: ...


SelectorFactory = Callable[[], selectors.BaseSelector]


class Run(Protocol):
    """One run of the lifecycle as its role's part sees it (`Supervisor`)."""

    cfg: Config
    clock: Clock
    log: Logger
    state: StateMachine

    def notify(self, **fields: str | int) -> None: ...

    def stop_signalled(self) -> bool: ...


class RolePart:
    """What the lifecycle asks of its deployment's role; one subclass per role in kimi_supervisor/deployment/,
    chosen once from the config (deployment/choose.py).  These defaults are a plain engine's."""

    # A requested stop of a READY child drains it (lifecycle/drain.py): its requests in flight may finish.
    drains = True

    def prepare_child(self, cfg: Config, prepared: PreparedSpawn | None, log: Logger) -> None:
        """Before the preflight, after the child's user is resolved: what the child needs made for it."""

    def before_preflight(self, run: Run) -> None:
        """What the run waits for before the preflight touches anything; StopRequested on a stop request."""

    def own_memory(self, cfg: Config, table: ProcessTable, probe: GpuProbe, gpus: tuple[int, ...]) -> dict[int, int]:
        """MiB per GPU that is this deployment's own though no process of its tree holds it (a stop does not wait
        for it to be freed)."""
        return {}


@dataclasses.dataclass
class Deps:
    """Everything the lifecycle talks to; the defaults are the real ones (the Protocols above)."""

    probe: GpuProbe
    table: ProcessTable
    notifier: Notifier
    log: Logger
    sink: ChildSink
    watchdog_s: float | None = None
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    signals: Signals = dataclasses.field(default_factory=SignalRecorder)
    clock: Clock | None = None  # None: the reactor's interruptible clock (Reactor.clock)
    spawn: Spawner = dataclasses.field(default_factory=ProcessSpawner)
    prober: ProberFactory = HealthProber
    liveness: LivenessFactory = DeepLiveness
    selector: SelectorFactory = selectors.DefaultSelector
    # The graceful stop of a serving vLLM (its /metrics, a SIGTERM to its main alone); None: the tree at once.
    drain: DrainFactory = Drain
    # vLLM's /metrics for the drain, the canary and the liveness thread's /metrics: one HTTP client.
    http: HttpClient = request
    # Wall-clock time for the operator's view (the state file's timestamps); the loop's time is `clock`.
    wall: Callable[[], float] = time.time
    # Notices when one of our check threads dies (threading.excepthook for the run): exit 70, not a silent gap.
    threads: ThreadWatch = dataclasses.field(default_factory=ThreadWatch)
    # The incident's stack dumper (opsview/forensics.py): py-spy when found, and what the file says of it.
    dumper: Callable[[], tuple[Dumper | None, str]] = default_dumper
    # What this run's role adds (kimi_supervisor/deployment/ chooses it from the config); a plain engine's.
    role: RolePart = dataclasses.field(default_factory=RolePart)
    # The main thread's one wait (reactor.py); None: one is made over `signals`, `selector()` and `clock`.
    reactor: Reactor = dataclasses.field(default=None)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.reactor is None:
            now = self.clock.monotonic if self.clock is not None else time.monotonic
            self.reactor = Reactor(self.signals, self.log, self.selector(), now=now)
