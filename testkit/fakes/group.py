"""A multi-node group node in fake time: lifecycle_world's fakes around `run_group_node`, peers as scripts.

The peers are what a test says they answer at each fake second (`leader(t)` / `follower(t)`: a PeerStatus, or
None for no answer; `master_port(t)`: a PortState), looked at on the real poller's schedule.  What this node
publishes is its GroupStatus, read directly (`status_at` records it at every look).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kimi_supervisor.config.model import Config, SpawnSpec
from kimi_supervisor.deployment.group.node import run_group_node
from kimi_supervisor.deployment.group.peers import Observation, PeerStatus, PortState
from kimi_supervisor.deployment.group.server import GroupStatus
from kimi_supervisor.exitcodes import EngineWedged, SupervisorError
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.lifecycle import (
    FakeChild,
    FakeProber,
    FakeSelector,
    FakeSignals,
    ListSink,
    RecordingNotifier,
    TimedLog,
)
from testkit.fakes.lifecycle_world import lifecycle_config

Peer = Callable[[float], "PeerStatus | None"]


# A peer() document names this node's own deployment and argv digest unless the test says otherwise: the
# GroupWorld fills them in from its config at each look.
OWN = "<own>"


def peer(role: str, rank: int, state: str, run_id: str, *, deployment: str = OWN, digest: str = OWN) -> PeerStatus:
    return PeerStatus(role, rank, run_id, state, digest, deployment)


class FakePoller:
    """Looks at each URL every `interval_s` fake seconds; what it sees is `answer(url, t)`."""

    def __init__(
        self,
        clock: FakeClock,
        urls: Sequence[str],
        master: tuple[str, int] | None,
        wake: Callable[[], None],
        interval_s: float,
        answer: Callable[[str, float], PeerStatus | None],
        port: Callable[[float], PortState],
    ) -> None:
        self._clock, self._urls, self._master, self._wake = clock, tuple(urls), master, wake
        self._interval, self._answer, self._port = interval_s, answer, port
        self._results: list[Observation] = []
        self.running = False
        self.looks: list[float] = []

    def start(self) -> None:
        self.running = True
        self._clock.after(0.0, self._look)

    def stop(self) -> None:
        self.running = False

    def observations(self) -> list[Observation]:
        out, self._results = self._results, []
        return out

    def _look(self) -> None:
        if not self.running:
            return
        t = self._clock.t
        self.looks.append(t)
        for url in self._urls:
            status = self._answer(url, t)
            port = self._port(t) if self._master is not None else None
            error = None if status is not None else "connection refused"
            port_error = "" if port in (None, PortState.OPEN) else f"connection {port.value}"
            self._results.append(Observation(url, self._clock.now, status, error, port, port_error))
        self._wake()
        self._clock.after(self._interval, self._look)


class GroupWorld:
    """One group node's whole life (every run) on one fake clock; `run()` returns its exit code."""

    def __init__(self, cfg: Config, *, watchdog_s: float | None = None, term_exit_after: float | None = 0.2) -> None:
        self.cfg = cfg
        self.clock = FakeClock()
        self.signals = FakeSignals()
        self.log = TimedLog(self.clock)
        self.notes = RecordingNotifier(self.clock)
        self.sink = ListSink()
        self.watchdog_s = watchdog_s
        self.term_exit_after = term_exit_after
        self.peers: dict[str, Peer] = {}
        self.master_port: Callable[[float], PortState] = lambda t: PortState.REFUSED
        self.script: Callable[[FakeChild, int], None] = lambda child, n: None
        self.children: list[FakeChild] = []
        self.spawned_at: list[float] = []
        self.status: GroupStatus | None = None
        self.states: list[tuple[float, str, str]] = []  # (t, state, run_id) at each change
        self.pollers: list[FakePoller] = []
        self.error: SupervisorError | None = None
        self.health: Callable[[float], int | None] = lambda t: None  # the leader's /health
        # From this fake second on, the leader's canary has failed failures_tolerated times (EngineWedged).
        self.canary_wedged_at: float | None = None

    # Spawner
    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> None:
        return None

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: object) -> FakeChild:
        child = FakeChild(self.clock, self.term_exit_after)
        self.children.append(child)
        self.spawned_at.append(self.clock.t)
        self.script(child, len(self.children))
        return child

    @property
    def child(self) -> FakeChild | None:
        return self.children[-1] if self.children else None

    def say_at(self, t: float, line: str) -> None:
        """`line` from whichever child is running at fake second `t`."""
        self.clock.at(t, lambda: self.child.say(line) if self.child and self.child.returncode is None else None)

    def signal_at(self, t: float, sig: int = signal.SIGTERM) -> None:
        self.clock.at(t, lambda: self.signals.send(sig))

    def _poller(self, urls: Sequence[str], master: tuple[str, int] | None, wake: Callable[[], None]) -> FakePoller:
        assert self.cfg.cluster is not None

        def answer(url: str, t: float) -> PeerStatus | None:
            self._note_state(t)
            status = self.peers[url](t)
            if status is None:
                return None
            assert self.cfg.cluster is not None
            return dataclasses.replace(
                status,
                deployment=self.cfg.deployment.name if status.deployment == OWN else status.deployment,
                argv_digest=self.cfg.cluster.argv_digest if status.argv_digest == OWN else status.argv_digest,
            )

        p = FakePoller(self.clock, urls, master, wake, self.cfg.cluster.probe_interval_s, answer, self.master_port)
        self.pollers.append(p)
        return p

    def _note_state(self, t: float) -> None:
        if self.status is not None:
            now = (self.status.state, self.status.run_id)
            if not self.states or self.states[-1][1:] != now:
                self.states.append((t, *now))

    def _serve(self, status: GroupStatus, cluster: object, log: object) -> None:
        self.status = status
        self._sample()
        return None

    def _sample(self) -> None:
        # What a peer would read, every fake 0.1 s (a peer looks once a second).
        self._note_state(self.clock.t)
        self.clock.after(0.1, self._sample)

    def run(self) -> int:
        deps = Deps(
            probe=FakeGpuProbe([]),
            table=PsutilProcessTable(),
            notifier=self.notes,
            log=self.log,
            sink=self.sink,
            watchdog_s=self.watchdog_s,
            environ={},
            signals=self.signals,
            clock=self.clock,
            spawn=self,
            prober=lambda url, timeout_s, interval_s, wake: FakeProber(self.clock, self.health, interval_s, wake),
            liveness=lambda given: _FakeDeepLiveness(self.clock, self.canary_wedged_at),
            selector=lambda: FakeSelector(self.clock),
            drain=lambda *args, **kw: None,  # the drain is tested in test_drain.py
            wall=self.clock.time,
        )
        try:
            return int(run_group_node(self.cfg, deps, pollers=self._poller, serve=self._serve))
        except SupervisorError as err:
            self.error = err
            return int(err.exit_code)
        finally:
            for child in self.children:
                child.close()
            for fd in (self.signals.read_fd, self.signals._write_fd):
                os.close(fd)

    def times(self, key: str, value: str | int | None = None) -> list[float]:
        return self.notes.times(key, value)


class _FakeDeepLiveness:
    """The leader's canary, token progress and GPU events are tested elsewhere: here fine until `wedged_at`,
    then the canary's verdict (EngineWedged) at every check."""

    healthy = True

    def __init__(self, clock: FakeClock, wedged_at: float | None) -> None:
        self._clock = clock
        self._wedged_at = wedged_at

    def start(self) -> None:
        return None

    def check(self) -> None:
        if self._wedged_at is not None and self._clock.t >= self._wedged_at:
            raise EngineWedged("engine wedged: the 1-token canary completion failed 2 times in a row (fake)")

    def in_flight_sample(self) -> tuple[float, float] | None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None


def group_config(tmp_path: Path, rank: int, **sections: dict[str, Any]) -> Config:
    """lifecycle_config for node `rank` of a two-node group whose leader is 10.77.0.1."""
    cluster: dict[str, Any] = {"nnodes": 2, "node_rank": rank, "master_addr": "10.77.0.1", "master_port": 29771}
    if rank == 0:
        cluster["peers"] = [FOLLOWER_URL]
    cluster.update(sections.pop("cluster", {}))
    child = {"argv": ["vllm", "serve", "/models/m", "--port", "8000", "-tp", "2"], **sections.pop("child", {})}
    return lifecycle_config(
        tmp_path,
        child=child,
        deployment={"role": "leader" if rank == 0 else "follower"},
        cluster=cluster,
        **sections,
    )


LEADER_URL = "http://10.77.0.1:29599/"
FOLLOWER_URL = "http://10.77.0.2:29599/"
# The follower's last line before the group forms (tests/fixtures/vllm_cpu_0.32/multinode_follower.log).
FOLLOWER_KV = (
    "(Worker_TP1 pid=27291) INFO 12-01 20:01:09 [cpu_worker.py:260] Explicitly set (1.0/8.96) GiB for KV cache "
    "on node 0."
)
FOLLOWER_LOADING = (
    "(Worker_TP1 pid=27291) INFO 12-01 20:01:08 [cpu_model_runner.py:68] Starting to load model /tmp/mn/tiny-llama..."
)
