"""What the lifecycle talks to, as small Protocols: `Supervisor` gets each through `Deps`.

`Deps`' defaults are the real ones (a spawned `ChildProcess`, a threaded `HealthProber`, `DeepLiveness`,
`drain.Drain`, a `DefaultSelector`, `liveness.http.request`, `time.time`); cli passes the `SignalRecorder`
and the `InterruptibleClock` over it.  The operator's view and the drain get the same clock, process table
and HTTP client as the rest.  testkit/fakes/lifecycle.py passes fakes and drives the whole lifecycle, the
drain included, on a fake clock in milliseconds, without patching anything.
"""

from __future__ import annotations

import selectors
from collections.abc import Callable, Mapping
from typing import Protocol

from kimi_supervisor.child.process import Child, PreparedSpawn
from kimi_supervisor.config.model import Config, SpawnSpec
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.lifecycle.drain import Drain
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.liveness.http import HttpClient
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd.notify import Notifier


class Spawner(Protocol):
    """Resolves user, groups and executable before the preflight acts (`prepare`), then spawns."""

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> PreparedSpawn | None: ...

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: PreparedSpawn | None) -> Child: ...


class Prober(Protocol):
    """Probes /health in the background; the loop drains results (health.HealthProber)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def set_interval(self, interval_s: float) -> None: ...

    def burst(self, interval_s: float, for_s: float) -> None: ...

    def drain(self) -> list[HealthResult]: ...


class ProberFactory(Protocol):
    def __call__(self, url: str, timeout_s: float, interval_s: float, wake: Callable[[], None]) -> Prober: ...


class Signals(Protocol):
    """Signal handlers that only record and wake the loop through `read_fd` (signals.SignalRecorder)."""

    read_fd: int
    stop_requested: bool

    def install(self) -> None: ...

    def uninstall(self) -> None: ...

    def wake(self) -> None: ...

    def drain(self) -> None: ...

    def new_signals(self) -> dict[int, int]: ...


class Liveness(Protocol):
    """Canary, token progress and GPU events while serving (liveness.DeepLiveness)."""

    @property
    def healthy(self) -> bool: ...

    def start(self) -> None: ...

    def check(self) -> None: ...

    def in_flight_sample(self) -> tuple[float, float] | None: ...  # (monotonic, running + waiting) for the stop

    def stop(self) -> None: ...

    def close(self) -> None: ...


class LivenessFactory(Protocol):
    """Builds the Liveness once READY (liveness.DeepLiveness): the config, the GPU probe, the GPUs to watch, the
    loop's wake-up, the notifier, the log, where each canary's (ok, latency_s) goes (the operator's view), the
    environment the child got (VLLM_API_KEY) and the HTTP client."""

    def __call__(
        self,
        cfg: Config,
        probe: GpuProbe,
        gpus: tuple[int, ...],
        wake: Callable[[], None],
        notifier: Notifier,
        log: Logger,
        on_canary: Callable[[bool, float], None],
        /,
        *,
        environ: Mapping[str, str],
        http: HttpClient,
    ) -> Liveness: ...


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
