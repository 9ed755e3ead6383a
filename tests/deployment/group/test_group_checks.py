"""A group node's dry run: role and consequence, VLLM_HOST_IP and the route, the master port, the peers."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.deployment.group.checks import Network, group_checks
from kimi_supervisor.deployment.group.peers import PeerStatus, PortState
from kimi_supervisor.preflight.checks import check_local_gpus
from testkit.fakes.group import group_config

ENV = {"VLLM_HOST_IP": "10.77.0.2", "GLOO_SOCKET_IFNAME": "kf0"}


def network(port: PortState = PortState.REFUSED, dev: str = "kf0", status: PeerStatus | None = None) -> Network:
    return Network(
        route=lambda addr: (dev, "10.77.0.2"),
        addresses=lambda: {"10.77.0.2": "kf0", "127.0.0.1": "lo"},
        port=lambda addr, port_, timeout: (port, "" if port is PortState.OPEN else f"connection {port.value}"),
        status=lambda url, timeout: (status, None if status else "connection refused"),
    )


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def follower(tmp_path: Path, env: dict[str, str] = ENV, **kw: object) -> dict[str, Check]:
    cfg = group_config(tmp_path, 1, child={"env": env, "inherit_environment": False})
    return by_name(group_checks(cfg, {}, network(**kw)))  # type: ignore[arg-type]


def test_follower_before_its_leader_started(tmp_path: Path) -> None:
    checks = follower(tmp_path)
    assert checks["group"].verdict is Verdict.OK
    assert "follower, node 1 of 2 (--nnodes 2 --node-rank 1" in checks["group"].message
    assert "--headless" in checks["group"].message
    assert "restarting this node restarts the group" in checks["group"].message
    assert checks["group.host_ip"].verdict is Verdict.OK and "is on kf0" in checks["group.host_ip"].message
    assert checks["group.route"].verdict is Verdict.OK
    refused = checks["group.master_port"]
    assert refused.verdict is Verdict.OK and "refused: leader not started" in refused.message  # information
    assert checks["group.leader"].verdict is Verdict.WARN


def test_a_timeout_is_a_failure_and_a_wrong_interface_is_named(tmp_path: Path) -> None:
    checks = follower(tmp_path, port=PortState.TIMEOUT, dev="eth0")
    assert checks["group.master_port"].verdict is Verdict.FAIL and "timeout" in checks["group.master_port"].message
    route = checks["group.route"]
    assert route.verdict is Verdict.FAIL and "leaves via eth0, but GLOO_SOCKET_IFNAME=kf0" in route.message


def test_host_ip_must_be_ours_and_the_peer_argv_the_same(tmp_path: Path) -> None:
    checks = follower(tmp_path, env={"VLLM_HOST_IP": "10.9.9.9"})
    assert (
        checks["group.host_ip"].verdict is Verdict.FAIL
        and "not an address of this host" in checks["group.host_ip"].message
    )
    assert checks["group.route"].verdict is Verdict.WARN  # nothing names the interface
    cfg = group_config(tmp_path, 1, child={"env": ENV, "inherit_environment": False})
    assert cfg.cluster is not None
    other = PeerStatus("leader", 0, "aa", "ready", "ff" * 32, cfg.deployment.name)
    checks = follower(tmp_path, port=PortState.OPEN, status=other)
    assert checks["group.leader"].verdict is Verdict.FAIL and "another argv" in checks["group.leader"].message
    elsewhere = PeerStatus("leader", 0, "aa", "ready", cfg.cluster.argv_digest, "other-deployment")
    checks = follower(tmp_path, port=PortState.OPEN, status=elsewhere)
    assert checks["group.leader"].verdict is Verdict.FAIL and "'other-deployment'" in checks["group.leader"].message
    same = PeerStatus("leader", 0, "aa", "starting", cfg.cluster.argv_digest, cfg.deployment.name)
    checks = follower(tmp_path, port=PortState.OPEN, status=same)
    assert checks["group.leader"].verdict is Verdict.OK and "is starting, run aa" in checks["group.leader"].message
    assert "the leader is at its rendezvous" in checks["group.master_port"].message


def test_leader_needs_its_port_free_and_its_share_of_gpus(tmp_path: Path) -> None:
    env = {"VLLM_HOST_IP": "10.77.0.1", "GLOO_SOCKET_IFNAME": "kl0"}
    cfg = group_config(tmp_path, 0, child={"env": env, "inherit_environment": False})
    net = Network(
        route=lambda addr: ("lo", "10.77.0.1"),
        addresses=lambda: {"10.77.0.1": "kl0"},
        port=lambda a, p, t: (PortState.OPEN, ""),
        status=lambda url, t: (None, "connection refused"),
    )
    checks = by_name(group_checks(cfg, {}, net))
    assert checks["group.route"].verdict is Verdict.OK  # its own address: the interface is VLLM_HOST_IP's
    assert (
        checks["group.master_port"].verdict is Verdict.FAIL and "already answers" in checks["group.master_port"].message
    )
    assert "the leader ends its run" not in checks["group"].message and "every follower" in checks["group"].message
    assert check_local_gpus(8, tuple(range(8)), 8, 2).verdict is Verdict.OK  # TP=16 over two 8-GPU hosts
    assert check_local_gpus(8, (0, 1, 2, 3), 8, 2).verdict is Verdict.FAIL
