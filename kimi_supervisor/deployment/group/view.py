"""`kimi-supervisor status` on a node of a multi-node group: this node's role and rank, and the group as it sees it.

Read from this node's own status endpoint (deployment/group/server.py), one bounded GET: the leader's state as a
follower last saw it, or each follower's state on the leader.  Nothing is asked of the peers themselves.
"""

from __future__ import annotations

from typing import Any

from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.liveness.http import request
from kimi_supervisor.quoting import escape_unprintable
from kimi_supervisor.untrusted_json import parse_json

TIMEOUT_S = 1.0


def own_status_url(cluster: ClusterConfig) -> str:
    host = f"[{cluster.status_address}]" if ":" in cluster.status_address else cluster.status_address
    return f"http://{host}:{cluster.status_port}/"


def fetch(cluster: ClusterConfig) -> tuple[dict[str, Any] | None, str | None]:
    answer = request("GET", own_status_url(cluster), TIMEOUT_S, max_body=256 * 1024)
    if answer.error is not None or answer.http_status != 200:
        return None, answer.error or f"HTTP {answer.http_status}"
    try:
        doc = parse_json(answer.body)
    except ValueError as exc:
        return None, str(exc)
    return (doc, None) if isinstance(doc, dict) else (None, "not a JSON object")


def group_lines(cluster: ClusterConfig, doc: dict[str, Any] | None, error: str | None) -> list[str]:
    role = "leader" if cluster.node_rank == 0 else "follower"
    head = f"{'Group':>12}: {role}, node {cluster.node_rank} of {cluster.nnodes}, master {cluster.master_addr}:"
    lines = [head + str(cluster.master_port)]
    if doc is None:
        lines.append(f"{'':>12}  status endpoint {own_status_url(cluster)}: {escape_unprintable(str(error))}")
        return lines
    run = doc.get("run_id") or "none"
    lines[0] += f"; this node {escape_unprintable(str(doc.get('state')))}, run {escape_unprintable(str(run))}"
    raw = doc.get("peers")
    peers: dict[str, Any] = raw if isinstance(raw, dict) else {}
    expected = cluster.peers if cluster.node_rank == 0 else (cluster.leader_status_url,)
    for url in expected:
        entry = peers.get(url)
        seen: dict[str, Any] | None = entry if isinstance(entry, dict) else None
        who = "Follower" if cluster.node_rank == 0 else "Leader"
        if seen is None:
            lines.append(f"{who:>12}: {url} not looked at yet")
        else:
            what = escape_unprintable(str(seen.get("state")))
            run_id = escape_unprintable(str(seen.get("run_id") or "none"))
            lines.append(f"{who:>12}: {url} {what}, run {run_id}")
    return lines
