"""The dry run of one node of a multi-node group: what this node is, and whether it can reach its group.

Each line says what a start would meet (docs/multi-node.md):
- the role and rank flags (written from [cluster]), and the consequence of restarting this node;
- the local GPUs against this node's share of the world (TP x PP x DP / nnodes);
- VLLM_HOST_IP is an address of this host, and the route to master_addr leaves through the interface that
  GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name (otherwise gloo or NCCL pick another and the group hangs);
- the master port: refused is information on a follower (the leader has not reached its rendezvous), a
  timeout or no route is a failure (a firewall, a partition, a wrong address);
- the peers' status endpoints: their state, and whether they are this group's (role, deployment, and argv with
  rank flags excluded and secrets redacted: a start would not believe them otherwise).
Read-only: one TCP connect and one GET per peer, each bounded; nothing is bound, killed or written.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import subprocess
from collections.abc import Callable, Mapping

import psutil

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.model import ClusterConfig, Config
from kimi_supervisor.deployment.group.peers import NetGroupProbe, PeerStatus, PortState, probe_port

TIMEOUT_S = 2.0
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def route_via(addr: str) -> tuple[str, str] | str:
    """(interface, source address) the kernel would use to reach `addr`, or why it cannot say."""
    try:
        out = subprocess.run(
            ["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=TIMEOUT_S
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip route get {addr}: {exc}"
    if "dev" not in out:
        return f"no route to {addr}"
    dev = out[out.index("dev") + 1]
    src = out[out.index("src") + 1] if "src" in out else ""
    return dev, src


def local_addresses() -> dict[str, str]:
    """address -> interface, for every address of this host."""
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out[a.address.split("%", 1)[0]] = name
    return out


@dataclasses.dataclass
class Network:
    """The host's side of the checks; tests pass their own."""

    route: Callable[[str], tuple[str, str] | str] = route_via
    addresses: Callable[[], Mapping[str, str]] = local_addresses
    port: Callable[[str, int, float], tuple[PortState, str]] = probe_port
    status: Callable[[str, float], tuple[PeerStatus | None, str | None]] = NetGroupProbe().status


def group_checks(cfg: Config, environ: Mapping[str, str], net: Network | None = None) -> list[Check]:
    cluster = cfg.cluster
    assert cluster is not None
    net = net if net is not None else Network()
    # What the child will see: child.env over the inherited environment (when it inherits).
    env = {**(environ if cfg.child.inherit_environment else {}), **cfg.child.env}
    leader = cluster.node_rank == 0
    out = [_role(cfg, cluster, leader)]
    out += _addresses(cluster, env, net, leader)
    out.append(_master_port(cluster, net, leader))
    for url in cluster.peers if leader else (cluster.leader_status_url,):
        out.append(_peer(url, cfg, net, leader))
    return out


def _role(cfg: Config, cluster: ClusterConfig, leader: bool) -> Check:
    argv = cfg.child.argv
    flags = []
    for i, arg in enumerate(argv):
        if arg in _RANK_FLAGS:
            valued = arg != "--headless" and i + 1 < len(argv)
            flags.append(f"{arg} {argv[i + 1]}" if valued else arg)
    if leader:
        consequence = "restarting this node restarts the group: every follower kills its tree and rejoins"
    else:
        consequence = "restarting this node restarts the group: the leader ends its run (exit 19) and restarts"
    return Check(
        "group",
        Verdict.OK,
        f"{cfg.role.value}, node {cluster.node_rank} of {cluster.nnodes} ({' '.join(flags)}); {consequence}",
        {"role": cfg.role.value, "node_rank": cluster.node_rank, "nnodes": cluster.nnodes},
    )


_RANK_FLAGS = (
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--distributed-executor-backend",
    "--headless",
)


def _addresses(cluster: ClusterConfig, env: Mapping[str, str], net: Network, leader: bool) -> list[Check]:
    out = []
    local = net.addresses()
    host_ip = env.get("VLLM_HOST_IP", "")
    if not host_ip:
        out.append(
            Check(
                "group.host_ip",
                Verdict.FAIL,
                "VLLM_HOST_IP is not set: vLLM would advertise the address of its route to 8.8.8.8 for the "
                "group's queues (set it to this node's cluster address in child.env)",
            )
        )
    elif host_ip not in local:
        out.append(Check("group.host_ip", Verdict.FAIL, f"VLLM_HOST_IP {host_ip} is not an address of this host"))
    else:
        out.append(Check("group.host_ip", Verdict.OK, f"VLLM_HOST_IP {host_ip} is on {local[host_ip]}"))
    if leader and host_ip and _same_address(cluster.master_addr) not in (host_ip, None):
        out.append(
            Check(
                "group.master_addr",
                Verdict.FAIL,
                f"the leader's master_addr {cluster.master_addr} is not its VLLM_HOST_IP {host_ip}",
            )
        )
    route = net.route(cluster.master_addr)
    if isinstance(route, str):
        out.append(Check("group.route", Verdict.FAIL, route))
        return out
    dev, src = route
    named = {var: env[var] for var in IFNAME_VARS if env.get(var)}
    if leader and dev == "lo":
        dev = local.get(host_ip, dev)  # the leader reaches its own address locally; its interface is host_ip's
    wrong = {var: name for var, name in named.items() if name.lstrip("^=").split(",")[0] != dev}
    if wrong:
        out.append(
            Check(
                "group.route",
                Verdict.FAIL,
                f"the route to {cluster.master_addr} leaves via {dev}, but "
                + ", ".join(f"{var}={name}" for var, name in wrong.items()),
                {"dev": dev, "src": src},
            )
        )
    elif not named:
        out.append(
            Check(
                "group.route",
                Verdict.WARN,
                f"the route to {cluster.master_addr} leaves via {dev}; neither GLOO_SOCKET_IFNAME nor "
                "NCCL_SOCKET_IFNAME names it (gloo and NCCL pick an interface of their own)",
                {"dev": dev, "src": src},
            )
        )
    else:
        out.append(
            Check(
                "group.route",
                Verdict.OK,
                f"the route to {cluster.master_addr} leaves via {dev} (src {src}), as {', '.join(named)} say",
                {"dev": dev, "src": src},
            )
        )
    return out


def _same_address(addr: str) -> str | None:
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        return None  # a host name: not compared


def _master_port(cluster: ClusterConfig, net: Network, leader: bool) -> Check:
    where = f"{cluster.master_addr}:{cluster.master_port}"
    state, error = net.port(cluster.master_addr, cluster.master_port, TIMEOUT_S)
    if leader:
        if state is PortState.OPEN:
            return Check(
                "group.master_port",
                Verdict.FAIL,
                f"{where} already answers: another leader (or a stale worker of ours) holds the rendezvous port",
            )
        return Check("group.master_port", Verdict.OK, f"{where} is free for the rendezvous")
    if state is PortState.OPEN:
        return Check("group.master_port", Verdict.OK, f"{where} answers: the leader is at its rendezvous")
    if state is PortState.REFUSED:
        return Check("group.master_port", Verdict.OK, f"{where} refused: leader not started (a start waits for it)")
    return Check(
        "group.master_port",
        Verdict.FAIL,
        f"{where}: {state.value} ({error}): a firewall, a partition or a wrong address, not a leader that is "
        "merely not started",
    )


def _peer(url: str, cfg: Config, net: Network, leader: bool) -> Check:
    assert cfg.cluster is not None
    who = "follower" if leader else "leader"
    status, error = net.status(url, TIMEOUT_S)
    if status is None:
        return Check(f"group.{who}", Verdict.WARN, f"{who} status {url}: {error} (not started yet?)")
    why = status.mismatch(who, cfg.deployment.name, cfg.cluster.argv_digest)
    if why is not None:
        # A start would not believe it either (deployment/group/node.py): name what differs.
        return Check(f"group.{who}", Verdict.FAIL, f"{who} {url} is not this group's {who}: {why}")
    run = f", run {status.run_id}" if status.run_id else ""
    return Check(f"group.{who}", Verdict.OK, f"{who} {url} (node {status.node_rank}) is {status.state}{run}")
