"""One node of a multi-node group: the lifecycle of `supervisor.py`, plus what makes the group one service.

vLLM's mp executor gives a group one rendezvous and a fixed world, and watches only each node's own workers
(docs/multi-node.md): a dead follower goes unseen by an idle leader, a dead leader by an idle follower, and a
restarted leader cannot use an old follower.  So the group restarts as a unit, from both ends, without a
controller (LeaderWorkerSet's RecreateGroupOnPodRestart, done per node):

- Every node serves its status (deployment/group/server.py): role, rank, the current run's id (fresh per
  spawn), and its state, "stopping" before its tree is stopped.
- The leader runs one `Supervisor`; its liveness adds each follower's status (`LeaderLiveness`): a follower
  unreachable `failures_tolerated` times, with another run id, or no longer ready ends the leader's run with
  exit 19 (PEER_LOST), idle or busy, and systemd restarts it.
- A follower waits for a leader run it may join (state "starting", a run id it has not joined before, the
  master port open, a document naming its own group: role, deployment, argv digest), then runs one
  `Supervisor` for it.  It is ready once its own load lines are in and the leader is ready with that run
  id (`FollowerLink`'s prober).  When that leader run ends (its status says stopping, its run id changed,
  or the leader stopped answering), the run ends with `LeaderGone`: the tree
  is stopped (orphans included, as every stop does), no STOPPING=1 reaches systemd, and the follower waits
  again, keeping the watchdog: no restart is consumed.  After `leader_wait_s` without a run to join: exit 20.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import urllib.parse
from collections.abc import Callable, Mapping, Sequence

from kimi_supervisor.child.process import Child, PreparedSpawn
from kimi_supervisor.clock import Clock, SystemClock
from kimi_supervisor.config.model import ClusterConfig, Config, SpawnSpec
from kimi_supervisor.deployment.group.checks import local_addresses
from kimi_supervisor.deployment.group.peers import Observation, PeerPoller, Poller, PollerFactory, PortState
from kimi_supervisor.deployment.group.server import GroupStatus, PeerAddresses, StatusServer, new_run_id
from kimi_supervisor.exitcodes import (
    AnotherInstance,
    ConfigError,
    EngineWedged,
    ExitCode,
    LeaderLost,
    PeerLost,
    ServiceUnavailable,
    SupervisorError,
)
from kimi_supervisor.host.instance_lock import locker
from kimi_supervisor.lifecycle.deps import Deps, Liveness, LivenessFactory, Spawner
from kimi_supervisor.lifecycle.signals import StopRequested
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.liveness.engine import LivenessInputs
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.preflight.checks import listener
from kimi_supervisor.roles import Role
from kimi_supervisor.systemd.notify import Notifier

WAIT_SAY_EVERY_S = 5.0
# A follower becomes ready within a probe or two of its leader; this long after the leader's READY, a follower
# that never said ready is lost too.
FOLLOWER_READY_GRACE_S = 15.0
_NOT_JOINED = ("preflight", "waiting", "stopping", "stopped", "failed")


class LeaderGone(LeaderLost):
    """The leader run this follower joined is over: its run ends; the follower waits for the next leader run.

    A LeaderLost (exit 20) only if it ever escaped the follower's loop; the run's history records it so.
    """


# -- the leader as a follower sees it ------------------------------------------------------------------------


class LeaderView:
    """The follower's verdicts from its looks at the leader (status and master port); no I/O, no clock."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self._cluster = cluster
        self.failures = 0
        self.last: Observation | None = None

    def observe(self, obs: Observation) -> None:
        self.failures = 0 if obs.reachable else self.failures + 1
        self.last = obs

    def joinable(self, joined: set[str]) -> str | None:
        """The run id of a leader run to join now, else None: starting, new to us, its master port open."""
        obs = self.last
        if obs is None or obs.status is None or obs.port is not PortState.OPEN:
            return None
        status = obs.status
        if status.state != "starting" or not status.run_id or status.run_id in joined:
            return None  # a ready leader has its world already; a stopping one is dying
        return status.run_id

    def ready_for(self, run_id: str) -> bool:
        obs = self.last
        return (
            obs is not None
            and obs.reachable
            and obs.status is not None
            and obs.status.state == "ready"
            and obs.status.run_id == run_id
        )

    def lost(self, run_id: str) -> str | None:
        """Why the leader run `run_id` is over, or None while it may still be on."""
        obs = self.last
        if obs is None:
            return None
        if obs.status is not None:
            if obs.status.run_id != run_id:
                return f"the leader's run changed ({run_id} -> {obs.status.run_id or 'none'})"
            if obs.status.state in _NOT_JOINED:
                return f"the leader is {obs.status.state}"
        if self.failures >= self._cluster.failures_tolerated:
            return f"the leader failed {self.failures} looks in a row ({obs.why})"
        return None

    def waiting_text(self) -> str:
        c = self._cluster
        where = f"waiting for leader {c.master_addr}:{c.master_port}"
        obs = self.last
        if obs is None:
            return where
        if obs.status is None:
            return f"{where} (status: {obs.error})"
        if obs.port is PortState.REFUSED:
            return f"{where} (leader {obs.status.state}; master port refused: not at its rendezvous yet)"
        if obs.port is not PortState.OPEN:
            return f"{where} (leader {obs.status.state}; master port {obs.port.value if obs.port else '?'})"
        return f"{where} (leader {obs.status.state}, run {obs.status.run_id or 'none'})"


class _Run:
    """One follower run's link to its leader run: what its prober and liveness read, and how it ended."""

    def __init__(self, view: LeaderView, poller: Poller, run_id: str, log: Logger) -> None:
        self.view = view
        self.poller = poller
        self.run_id = run_id
        self.log = log
        self.gone: str | None = None

    def update(self) -> list[Observation]:
        """Take the new looks; raise LeaderGone once the leader run is over."""
        fresh = self.poller.observations()
        for obs in fresh:
            self.view.observe(obs)
        why = self.view.lost(self.run_id)
        if why is not None:
            self.gone = why
            raise LeaderGone(f"leader run {self.run_id} is over: {why}")
        return fresh


class _LeaderProber:
    """The follower's readiness and health: "the leader is ready with the run we joined".

    `new_results` raises LeaderGone while starting too (the loop calls nothing else then), so a leader that dies
    mid-rendezvous ends the follower's run within the same bound as a serving one.
    """

    def __init__(self, run: _Run) -> None:
        self._run = run

    def start(self) -> None:
        return None  # the poller runs for the whole follower process

    def stop(self) -> None:
        return None

    def set_interval(self, interval_s: float) -> None:
        return None

    def burst(self, interval_s: float, for_s: float) -> None:
        return None

    def new_results(self) -> list[HealthResult]:
        out = []
        for obs in self._run.update():
            ok = self._run.view.ready_for(self._run.run_id)
            error = None if ok else obs.why
            out.append(HealthResult(ok=ok, http_status=200 if ok else None, error=error, at=obs.at, latency_s=0.0))
        return out


class _FollowerLiveness:
    """A follower has no API, so no canary: its liveness is its leader run's (its own tree is the loop's)."""

    def __init__(self, run: _Run) -> None:
        self._run = run

    @property
    def healthy(self) -> bool:
        return self._run.gone is None and self._run.view.ready_for(self._run.run_id)

    def start(self) -> None:
        return None

    def check(self) -> None:
        self._run.update()

    def in_flight_sample(self) -> tuple[float, float] | None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None


# -- the followers as the leader sees them -------------------------------------------------------------------


@dataclasses.dataclass
class _Track:
    failures: int = 0
    run_id: str = ""  # the run it was ready with
    last: Observation | None = None


class LeaderLiveness:
    """DeepLiveness (canary, token progress, GPU events) plus every follower's status: PeerLost when one is lost."""

    def __init__(self, deep: Liveness, poller: Poller, cluster: ClusterConfig, clock: Clock, log: Logger) -> None:
        self._deep = deep
        self._poller = poller
        self._cluster = cluster
        self._clock = clock
        self._log = log
        self._tracks = {url: _Track() for url in cluster.peers}
        self._since = clock.monotonic()

    @property
    def healthy(self) -> bool:
        return self._deep.healthy and all(t.failures == 0 for t in self._tracks.values())

    def start(self) -> None:
        self._since = self._clock.monotonic()
        self._deep.start()
        self._poller.start()

    def check(self) -> None:
        try:
            self._deep.check()
        except EngineWedged as wedged:
            # The canary's request runs on every node: a follower lost mid-step fails it (TP) or times it out
            # (PP) before failures_tolerated looks have condemned that follower. Where a follower is failing
            # too, the cause is the peer: 19 (the group restarts from this end), not 17 (this engine wedged).
            for obs in self._poller.observations():
                self._observe(obs)
            suspect = self._failing_follower()
            if suspect is None:
                raise
            raise PeerLost(f"{wedged.message}, while {suspect}") from wedged
        for obs in self._poller.observations():
            self._observe(obs)
        now = self._clock.monotonic()
        for url, track in self._tracks.items():
            if not track.run_id and now - self._since > FOLLOWER_READY_GRACE_S:
                seen = track.last.why if track.last is not None else "no answer yet"
                raise PeerLost(f"follower {url} not ready {FOLLOWER_READY_GRACE_S:g}s after the leader ({seen})")

    def _failing_follower(self) -> str | None:
        """A follower whose last look failed (not yet failures_tolerated times), in words; None if all answer."""
        for url, track in self._tracks.items():
            if track.failures and track.last is not None:
                return f"follower {url} failed {track.failures} look(s) in a row ({track.last.why})"
        return None

    def _observe(self, obs: Observation) -> None:
        track = self._tracks.get(obs.url)
        if track is None:
            return
        track.last = obs
        if obs.status is None:
            track.failures += 1
            if track.failures >= self._cluster.failures_tolerated:
                raise PeerLost(f"follower {obs.url} failed {track.failures} looks in a row ({obs.why})")
            return
        track.failures = 0
        status = obs.status
        if track.run_id and status.run_id != track.run_id:
            raise PeerLost(f"follower {obs.url}: its run changed ({track.run_id} -> {status.run_id or 'none'})")
        if status.state == "ready":
            if not track.run_id:
                self._log.info("group.follower_ready", url=obs.url, node_rank=status.node_rank, run_id=status.run_id)
            track.run_id = status.run_id
        elif track.run_id:
            raise PeerLost(f"follower {obs.url} is {status.state}")

    def in_flight_sample(self) -> tuple[float, float] | None:
        return self._deep.in_flight_sample()

    def stop(self) -> None:
        self._poller.stop()
        self._deep.stop()

    def close(self) -> None:
        self._poller.stop()
        self._deep.close()


# -- the seams around one Supervisor run --------------------------------------------------------------------


@dataclasses.dataclass
class _RunSpawner:
    """Each spawn is a new run: a fresh run id, published as "starting" before vLLM exists."""

    inner: Spawner
    status: GroupStatus

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> PreparedSpawn | None:
        return self.inner.prepare(spec, parent_env)

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: PreparedSpawn | None) -> Child:
        self.status.set("starting", new_run_id())
        return self.inner.spawn(spec, parent_env, prepared)


@dataclasses.dataclass
class _StatusTap:
    """What the lifecycle tells systemd, published to the peers too (READY=1: ready; STOPPING=1: stopping).

    On a follower whose leader run is over, STOPPING=1 stays ours: systemd would take it for the unit's own
    stop and kill it after TimeoutStopSec.  After its first READY a follower pets the watchdog on every
    datagram of a later run's start too, since systemd's watchdog stays armed while it waits and restarts.
    """

    inner: Notifier
    status: GroupStatus
    run: _Run | None = None
    watchdog: bool = False
    ever_ready: bool = False

    def send(self, **fields: str | int) -> None:
        if "STOPPING" in fields:
            self.status.set("stopping")
            if self.run is not None and self.run.gone is not None:
                fields.pop("STOPPING")
        if "READY" in fields:
            self.status.set("ready")
            self.ever_ready = True
        elif self.ever_ready and self.watchdog and "WATCHDOG" not in fields:
            fields["WATCHDOG"] = 1
        self.inner.send(**fields)


def _poller_factory(cluster: ClusterConfig) -> PollerFactory:
    def make(urls: Sequence[str], master: tuple[str, int] | None, wake: Callable[[], None]) -> Poller:
        return PeerPoller(urls, master, wake, interval_s=cluster.probe_interval_s, timeout_s=cluster.probe_timeout_s)

    return make


@dataclasses.dataclass
class _Seen:
    """A poller whose looks are checked and published: a document that is not the peer this node's config
    names (another role, deployment or argv digest: say, a local user's listener on a peer's status port) is a
    failed look, logged once per reason; `status` on this node shows how it saw each peer."""

    inner: Poller
    status: GroupStatus
    expect: tuple[str, str, str]  # the peers' role, deployment and argv digest
    log: Logger
    refused: dict[str, str] = dataclasses.field(default_factory=dict)

    def start(self) -> None:
        self.inner.start()

    def stop(self) -> None:
        self.inner.stop()

    def observations(self) -> list[Observation]:
        looks = [self._vet(obs) for obs in self.inner.observations()]
        for obs in looks:
            if obs.status is not None:
                self.status.seen(obs.url, obs.status.state, obs.status.run_id)
            else:
                self.status.seen(obs.url, "unreachable", "")
        return looks

    def _vet(self, obs: Observation) -> Observation:
        why = obs.status.mismatch(*self.expect) if obs.status is not None else None
        if why is None:
            self.refused.pop(obs.url, None)
            return obs
        if self.refused.get(obs.url) != why:
            self.refused[obs.url] = why
            self.log.warning("group.peer_refused", url=obs.url, why=why, role=self.expect[0])
        return dataclasses.replace(obs, status=None, error=f"not this group's {self.expect[0]}: {why}")


def _seen_by(status: GroupStatus, cfg: Config, log: Logger, make: PollerFactory) -> PollerFactory:
    assert cfg.cluster is not None
    peer_role = Role.FOLLOWER if cfg.role is Role.LEADER else Role.LEADER
    expect = (peer_role.value, cfg.deployment.name, cfg.cluster.argv_digest)

    def wrapped(urls: Sequence[str], master: tuple[str, int] | None, wake: Callable[[], None]) -> Poller:
        return _Seen(make(urls, master, wake), status, expect, log)

    return wrapped


ServerFactory = Callable[[GroupStatus, ClusterConfig, Logger], "StatusServer | None"]


def _serve_status(status: GroupStatus, cluster: ClusterConfig, log: Logger) -> StatusServer:
    """Bound before the preflight; taken, it is exit 16 naming the listener (the config's lock covers a second
    supervisor; this, anyone else's listener), never an internal error."""
    hosts = [urllib.parse.urlsplit(url).hostname or "" for url in (*cluster.peers, cluster.leader_status_url)]
    peers = PeerAddresses([*hosts, cluster.master_addr], lambda: local_addresses().keys(), log)
    server = StatusServer(status, cluster.status_address, cluster.status_port, log, peers)
    where = f"{cluster.status_address}:{cluster.status_port} (cluster.status_port)"
    try:
        server.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            pid, _ = listener(cluster.status_port)
            who = locker(pid).describe() if pid is not None else "a process this host does not name"
            raise AnotherInstance(f"the status endpoint's {where} is taken by {who}; nothing was changed") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"cluster.status_address: {cluster.status_address} is not an address of this host"
            ) from None
        raise ServiceUnavailable(f"cannot serve the status endpoint on {where}: {exc.strerror}") from None
    return server


def run_group_node(
    cfg: Config,
    deps: Deps,
    secrets: tuple[str, ...] = (),
    *,
    pollers: PollerFactory | None = None,
    serve: ServerFactory = _serve_status,
) -> ExitCode:
    """Supervise this node of its group until a stop request (0) or a failure (its SupervisorError)."""
    cluster = cfg.cluster
    assert cluster is not None and cfg.role.in_group
    status = GroupStatus(cfg.role.value, cluster.node_rank, cfg.deployment.name, cluster.argv_digest)
    server = serve(status, cluster, deps.log)
    make_poller = _seen_by(status, cfg, deps.log, pollers if pollers is not None else _poller_factory(cluster))
    try:
        if cfg.role is Role.LEADER:
            code = _leader(cfg, deps, secrets, status, make_poller)
        else:
            code = _Follower(cfg, deps, secrets, status, make_poller).run()
        status.set("stopped")
        return code
    except SupervisorError:
        status.set("failed")
        raise
    finally:
        if server is not None:
            server.stop()


def _leader(
    cfg: Config, deps: Deps, secrets: tuple[str, ...], status: GroupStatus, make_poller: PollerFactory
) -> ExitCode:
    cluster = cfg.cluster
    assert cluster is not None
    clock = deps.clock if deps.clock is not None else SystemClock()
    inner: LivenessFactory = deps.liveness

    def liveness(given: LivenessInputs) -> Liveness:
        deep = inner(given)
        return LeaderLiveness(deep, make_poller(cluster.peers, None, given.wake), cluster, clock, given.log)

    run_deps = dataclasses.replace(
        deps,
        spawn=_RunSpawner(deps.spawn, status),
        notifier=_StatusTap(deps.notifier, status),
        liveness=liveness,
    )
    return Supervisor(cfg, run_deps, secrets).run()


class _Follower:
    def __init__(
        self, cfg: Config, deps: Deps, secrets: tuple[str, ...], status: GroupStatus, make_poller: PollerFactory
    ) -> None:
        assert cfg.cluster is not None
        self.cfg, self.cluster, self.deps, self.secrets, self.status = cfg, cfg.cluster, deps, secrets, status
        self.log = deps.log
        self.clock: Clock = deps.clock if deps.clock is not None else deps.reactor.clock
        self.view = LeaderView(self.cluster)
        master = (self.cluster.master_addr, self.cluster.master_port)
        self.poller = make_poller([self.cluster.leader_status_url], master, deps.reactor.wake)
        self.joined: set[str] = set()
        self.tap = _StatusTap(deps.notifier, status, watchdog=bool(deps.watchdog_s))

    def run(self) -> ExitCode:
        # Our handlers stay in place between runs (each run's Supervisor installs them again on top).
        self.deps.signals.install()
        self.poller.start()
        try:
            while True:
                run_id = self._wait_for_leader()
                if run_id is None:
                    return ExitCode.OK
                self.joined.add(run_id)
                try:
                    return self._run_once(run_id)
                except LeaderGone as exc:
                    # The tree is gone (every stop kills the whole tree, orphans included): wait for a new run.
                    self.log.warning("group.leader_lost", run_id=run_id, error=exc.message)
        finally:
            self.poller.stop()
            self.deps.signals.uninstall()

    def _run_once(self, run_id: str) -> ExitCode:
        run = _Run(self.view, self.poller, run_id, self.log)
        self.tap.run = run
        self.log.info("group.joining", leader=self.cluster.leader_status_url, run_id=run_id)
        run_deps = dataclasses.replace(
            self.deps,
            spawn=_RunSpawner(self.deps.spawn, self.status),
            notifier=self.tap,
            prober=lambda url, timeout_s, interval_s, wake: _LeaderProber(run),
            liveness=lambda given: _FollowerLiveness(run),
        )
        return Supervisor(self.cfg, run_deps, self.secrets).run()

    def _wait_for_leader(self) -> str | None:
        """A leader run to join; None on a stop request; LeaderLost after cluster.leader_wait_s."""
        c = self.cluster
        start = self.clock.monotonic()
        self.status.set("waiting")
        last_said = -math.inf
        last_pet = -math.inf
        pet_every = self.deps.watchdog_s / 2 if self.deps.watchdog_s else None
        while True:
            for obs in self.poller.observations():
                self.view.observe(obs)
            run_id = self.view.joinable(self.joined)
            if run_id is not None:
                return run_id
            if self.deps.reactor.stop_signalled("waiting", sticky=True):
                return None
            now = self.clock.monotonic()
            if now - start > c.leader_wait_s:
                raise LeaderLost(
                    f"no leader run to join at {c.master_addr}:{c.master_port} within {c.leader_wait_s:g}s "
                    f"(cluster.leader_wait_s): {self.view.waiting_text()}"
                )
            fields: dict[str, str | int] = {}
            if now - last_said >= WAIT_SAY_EVERY_S:
                last_said = now
                fields["STATUS"] = self.view.waiting_text()
                self.log.info("group.waiting", why=fields["STATUS"])
            if pet_every is not None and now - last_pet >= pet_every:
                last_pet = now
                fields["WATCHDOG"] = 1  # the supervisor is healthy: it is waiting on purpose
            if fields:
                self.deps.notifier.send(**fields)
            try:
                self.clock.sleep(min(c.probe_interval_s, 0.5))
            except StopRequested:
                return None
