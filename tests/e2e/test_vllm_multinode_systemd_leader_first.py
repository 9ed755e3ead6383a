"""A real two-node vLLM group under the real systemd, started the leader first: tier C of the multi-node tests
(docs/multi-node.md; the machinery: tests/e2e/multinode_systemd.py; the follower-first and together starts:
tests/e2e/test_vllm_multinode_systemd.py).  Its own machines, subnet and veth pair, so it runs beside that file.

Each test leaves the group in the state the next one starts from:
4. the leader first (its worker at the rendezvous, the master port open), then the follower; a follower worker
   SIGKILLed (the headless main then exits 0 by itself): the leader exits 19 (PEER_LOST), the
   follower 13, systemd restarts both (NRestarts +1 each), the group serves again, no orphan;
5. the follower's end of the veth pair down (a silent partition): the leader exits 19 and systemd
   restarts it, the follower's tree is gone with no restart; the link up again: the follower joins
   the leader's new run with no operator action;
6. the leader's vLLM main SIGKILLed (not its supervisor): the leader's supervisor stops its tree (the orphaned
   EngineCore and worker too) and exits 13, systemd restarts it; the follower's tree is gone with no restart of its
   own; both stopped while the leader starts again (the rejoin is 5's).
Three group starts (one clean start, two restarts after a fault): the least these scenarios need.
"""

from __future__ import annotations

import time

import pytest

from kimi_supervisor.exitcodes import ExitCode
from tests.conftest import wait_for
from tests.e2e.multinode_systemd import (
    GROUP_READY_S,
    HANG_S,
    MASTER_PORT,
    UNIT,
    Node,
    assert_group_serving,
    ensure_group,
    follower_fault_restarts_both,
    module_fixtures,
    wait_serving,
)

pytestmark = [pytest.mark.multinode, pytest.mark.systemd]

# The other file's group has its own subnet and names: both can run at once.
group, report, measured = module_fixtures("10.79.0", "t")


def test_leader_first_then_a_follower_worker_killed(group: tuple[Node, Node]) -> None:
    leader, follower = group
    l_restarts = leader.nrestarts()
    started = time.monotonic()
    leader.m.systemctl("start", "--no-block", UNIT)
    # The leader first, really: its rank-0 worker at the rendezvous (the master port open), waiting for a follower
    # that is not even started.
    wait_for(lambda: leader.listening(MASTER_PORT), timeout=GROUP_READY_S, interval=0.5)
    measured["leader_first_master_port_s"] = time.monotonic() - started
    assert follower.prop("ActiveState") == "inactive" and not leader.serving()
    follower.m.systemctl("start", "--no-block", UNIT)
    measured["leader_first_group_ready_s"] = wait_serving(leader, follower)
    assert leader.nrestarts() == l_restarts  # the leader waited at its rendezvous, it did not fail
    assert_group_serving(leader, follower)

    # A worker dies, not the main: the headless main notices and exits 0 (vLLM's own monitor), which is 13 for
    # the follower; the leader's /health stays 200 meanwhile (vLLM alone), so 19 is the supervisors' doing.
    [worker, *_] = follower.workers()
    follower_fault_restarts_both(leader, follower, worker, "follower_worker_killed", measured)


def test_follower_link_down_then_up(group: tuple[Node, Node]) -> None:
    leader, follower = group
    ensure_group(leader, follower)
    l_restarts, f_restarts, f_main = leader.nrestarts(), follower.nrestarts(), follower.main_ident()
    old = leader.vllm_procs() | follower.vllm_procs()
    cut_wall, cut = time.time(), time.monotonic()
    follower.link(up=False)
    try:
        # The follower's status stops answering (timeouts, nothing refused): the leader's run ends with 19.
        wait_for(lambda: leader.exits(cut_wall), timeout=HANG_S, interval=0.5)
        [(leader_exit_s, leader_status)] = leader.exits(cut_wall)[:1]
        measured["partition_leader_exit_s"] = leader_exit_s
        assert leader_status == ExitCode.PEER_LOST
        # The follower cannot reach its leader either: its tree goes, the same process waits.
        wait_for(lambda: not follower.vllm_procs() & old, timeout=HANG_S, interval=0.2)
        measured["partition_follower_tree_gone_s"] = time.monotonic() - cut
        # systemd restarts the leader; its new run waits at its rendezvous, behind the partition.
        wait_for(lambda: leader.nrestarts() == l_restarts + 1, timeout=HANG_S, interval=0.5)
        wait_for(lambda: leader.listening(MASTER_PORT), timeout=GROUP_READY_S, interval=0.5)
        assert (follower.main_ident(), follower.nrestarts(), follower.exits(cut_wall)) == (f_main, f_restarts, [])
        assert not follower.serving() and follower.vllm_procs() == set()
    finally:
        healed = time.monotonic()
        follower.link(up=True)
    # No operator action: the follower sees the leader's new run and joins it.
    wait_serving(leader, follower)
    measured["partition_healed_group_ready_s"] = time.monotonic() - healed
    assert (leader.nrestarts(), follower.nrestarts()) == (l_restarts + 1, f_restarts)
    assert [s for _, s in leader.exits(cut_wall)] == [ExitCode.PEER_LOST]
    assert (follower.main_ident(), follower.exits(cut_wall)) == (f_main, [])
    assert_group_serving(leader, follower)
    assert not old & (leader.vllm_procs() | follower.vllm_procs())


def test_leader_vllm_main_killed(group: tuple[Node, Node]) -> None:
    leader, follower = group
    ensure_group(leader, follower)
    l_restarts, f_restarts, f_main = leader.nrestarts(), follower.nrestarts(), follower.main_ident()
    old = leader.vllm_procs() | follower.vllm_procs()
    killed_wall, killed = time.time(), time.monotonic()
    leader.kill(leader.vllm_main())  # the API server: its EngineCore and worker would live on as orphans
    # The leader's supervisor stops its tree and exits 13, like one node's; its status said "stopping" first, so
    # the follower's tree goes within the bound, without a restart of its own.
    wait_for(lambda: not follower.vllm_procs() & old, timeout=HANG_S, interval=0.2)
    measured["leader_main_killed_follower_tree_gone_s"] = time.monotonic() - killed
    wait_for(lambda: leader.exits(killed_wall), timeout=HANG_S, interval=0.5)
    [(leader_exit_s, leader_status)] = leader.exits(killed_wall)[:1]
    measured["leader_main_killed_leader_exit_s"] = leader_exit_s
    assert leader_status == ExitCode.CHILD_DIED
    assert not leader.vllm_procs() & old  # the orphaned EngineCore and worker went with the tree
    wait_for(lambda: leader.nrestarts() == l_restarts + 1, timeout=HANG_S, interval=0.5)
    assert [s for _, s in leader.exits(killed_wall)] == [ExitCode.CHILD_DIED]
    assert (follower.main_ident(), follower.nrestarts(), follower.exits(killed_wall)) == (f_main, f_restarts, [])
    assert not old & (leader.vllm_procs() | follower.vllm_procs())
    assert leader.orphans() == set() and follower.orphans() == set()
    # Not waited for: the group serving again, which is test_follower_link_down_then_up's heal (the same follower
    # process joins its restarted leader's new run); a group start is ~60 s of CPU (issue 52).  Both stopped
    # mid-start instead: a clean stop either way.
    for n in (leader, follower):
        n.m.systemctl("stop", UNIT, timeout=90)
        assert n.vllm_procs() == set() and n.prop("ExecMainStatus") == "0"
