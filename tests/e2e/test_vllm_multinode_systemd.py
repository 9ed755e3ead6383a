"""A real two-node vLLM group under the real systemd, started the follower first and both together: tier C of the
multi-node tests (docs/multi-node.md; the machinery and what a group is: tests/e2e/multinode_systemd.py; the
leader-first scenarios: tests/e2e/test_vllm_multinode_systemd_leader_first.py).

A group start is ~40 s on 2 cores (two vLLM trees), so the scenarios are few, serial, and each test leaves the
group in the state the next one starts from where it can:
1. follower first, then the leader; `systemctl stop` of the leader: a clean stop (status 0), the follower's tree
   gone, the follower still active (same MainPID, no restart), waiting;
2. both started together; the follower's vLLM main SIGKILLed: the follower exits 13, the leader exits 19
   (PEER_LOST), systemd restarts both (NRestarts +1 each), the group serves again, no orphan;
3. the leader's supervisor SIGKILLed: systemd kills the leader's tree and restarts it; the follower's tree is gone
   with no restart of its own, no orphan; both stopped while the leader starts again (that the same follower joins
   its leader's new run is the leader-first file's partition heal).
Three group starts (two clean starts, one restart after a fault): the least these scenarios need.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for
from tests.e2e.multinode_systemd import (
    GROUP_READY_S,
    HANG_S,
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
group, report, measured = module_fixtures("10.78.0", "s")


def test_follower_first_then_leader_stopped(group: tuple[Node, Node]) -> None:
    leader, follower = group
    follower.m.systemctl("start", "--no-block", UNIT)  # READY only once the leader serves
    wait_for(lambda: follower.prop("StatusText").startswith("waiting for leader"), timeout=HANG_S, interval=0.2)
    assert follower.vllm_procs() == set()  # a waiting follower spawns nothing
    started = time.monotonic()
    leader.m.systemctl("start", UNIT, timeout=GROUP_READY_S)  # returns at the leader's READY=1
    measured["follower_first_leader_ready_s"] = time.monotonic() - started
    wait_serving(follower)
    measured["follower_first_group_ready_s"] = time.monotonic() - started
    assert_group_serving(leader, follower)

    f_main, f_restarts, l_restarts = follower.main_ident(), follower.nrestarts(), leader.nrestarts()
    stop_wall, stop = time.time(), time.monotonic()
    leader.m.systemctl("stop", UNIT, timeout=90)
    measured["leader_stop_s"] = time.monotonic() - stop
    assert (leader.prop("ActiveState"), leader.prop("ExecMainStatus")) == ("inactive", "0")
    assert leader.exits(stop_wall) == []  # systemd logs only an unclean exit of the main process
    assert leader.vllm_procs() == set() and leader.nrestarts() == l_restarts
    wait_for(lambda: not follower.vllm_procs(), timeout=HANG_S, interval=0.2)
    measured["leader_stopped_follower_tree_gone_s"] = time.monotonic() - stop
    # The follower waits: the same process, no restart consumed, still active for systemd.
    assert (follower.main_ident(), follower.nrestarts(), follower.prop("ActiveState")) == (
        f_main,
        f_restarts,
        "active",
    )
    wait_for(lambda: follower.prop("StatusText").startswith("waiting for leader"), timeout=HANG_S, interval=0.2)
    assert follower.exits(stop_wall) == []

    follower.m.systemctl("stop", UNIT, timeout=90)
    assert (follower.prop("ActiveState"), follower.prop("ExecMainStatus")) == ("inactive", "0")
    assert follower.vllm_procs() == set()


def test_both_together_then_follower_main_killed(group: tuple[Node, Node]) -> None:
    leader, follower = group
    leader.m.systemctl("start", "--no-block", UNIT)
    follower.m.systemctl("start", "--no-block", UNIT)
    measured["together_group_ready_s"] = wait_serving(leader, follower)
    assert_group_serving(leader, follower)

    follower_fault_restarts_both(leader, follower, follower.vllm_main(), "follower_main_killed", measured)


def test_leader_supervisor_sigkilled(group: tuple[Node, Node]) -> None:
    leader, follower = group
    ensure_group(leader, follower)
    l_restarts, f_restarts, f_main = leader.nrestarts(), follower.nrestarts(), follower.main_ident()
    old = leader.vllm_procs() | follower.vllm_procs()
    killed_wall, killed = time.time(), time.monotonic()
    leader.m.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
    # systemd stops the rest of the leader's cgroup (KillMode=mixed) and restarts it; the follower sees its
    # leader's run gone and stops its own tree, without exiting.
    wait_for(lambda: not follower.vllm_procs() & old, timeout=HANG_S, interval=0.2)
    measured["leader_sigkilled_follower_tree_gone_s"] = time.monotonic() - killed
    wait_for(lambda: leader.nrestarts() == l_restarts + 1, timeout=HANG_S, interval=0.5)
    assert [s for _, s in leader.exits(killed_wall)] == [-1]  # killed by a signal, not an exit status
    assert (follower.main_ident(), follower.nrestarts(), follower.exits(killed_wall)) == (f_main, f_restarts, [])
    assert not old & (leader.vllm_procs() | follower.vllm_procs())
    assert leader.orphans() == set() and follower.orphans() == set()
    # Not waited for: the group serving again.  The same follower process joining its restarted leader's new run is
    # the partition's heal (test_vllm_multinode_systemd_leader_first.py::test_follower_link_down_then_up), and a
    # group start is ~60 s of CPU (issue 52).  Both stopped mid-start instead: a clean stop either way.
    for n in (leader, follower):
        n.m.systemctl("stop", UNIT, timeout=90)
        assert n.vllm_procs() == set() and n.prop("ExecMainStatus") == "0"
