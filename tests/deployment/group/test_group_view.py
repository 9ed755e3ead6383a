"""`status` on a group node: its role and rank, and each peer's state as this node last saw it."""

from __future__ import annotations

from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.deployment.group.server import GroupStatus, PeerAddresses, StatusServer
from kimi_supervisor.deployment.group.view import fetch, group_lines
from testkit.fakes.log import RecordingLog

PEER = "http://10.77.0.2:29599/"


def test_the_leader_shows_each_follower_as_it_saw_it() -> None:
    status = GroupStatus("leader", 0, "kimi", "")
    log = RecordingLog()
    # Served to this host (loopback) though only 10.77.0.2 is a peer: `status` reads its own node's endpoint.
    server = StatusServer(status, "127.0.0.1", 0, log, PeerAddresses(["10.77.0.2"], lambda: [], log))
    server.start()
    port = server.bound_port
    try:
        cluster = ClusterConfig(2, 0, "10.77.0.1", 29771, status_port=port, peers=(PEER,))
        status.set("ready", "aa01")
        lines = group_lines(cluster, *fetch(cluster))
        assert lines[0].endswith("leader, node 0 of 2, master 10.77.0.1:29771; this node ready, run aa01")
        assert lines[1].endswith(f"Follower: {PEER} not looked at yet")
        status.seen(PEER, "ready", "ff01")
        assert group_lines(cluster, *fetch(cluster))[1].endswith(f"Follower: {PEER} ready, run ff01")
        status.seen(PEER, "\x1b[2Jstopping", "")
        assert "\x1b" not in "".join(group_lines(cluster, *fetch(cluster)))  # a peer's words, escaped
    finally:
        server.stop()
    cluster = ClusterConfig(2, 1, "10.77.0.1", 29771, status_port=port, leader_status_url="http://x/")
    lines = group_lines(cluster, *fetch(cluster))
    assert "follower, node 1 of 2" in lines[0] and "connection refused" in lines[1]
