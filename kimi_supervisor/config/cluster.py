"""A multi-node group's config (docs/multi-node.md): `[cluster]`, read exactly for a group node (config/role_spec.py
node_ranks), and what it changes in the rest: the rank flags in child.argv, the leader's canary, a follower's
readiness and stop defaults.  config/load.py calls `parse_cluster`, then `apply_cluster` with the other tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kimi_supervisor.config import role_spec
from kimi_supervisor.config.model import (
    ChildConfig,
    ClusterConfig,
    LivenessConfig,
    PreflightConfig,
    ReadinessConfig,
    ShutdownConfig,
)
from kimi_supervisor.config.rank_flags import RankFlagError, group_argv, strip_rank_flags
from kimi_supervisor.config.table import MISSING, Table, short_repr
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.redact import redact_argv
from kimi_supervisor.roles import Role

_STATUS_URL = re.compile(r"^http://[^/\s]+(/\S*)?$")
# The group's bounds (docs/multi-node.md): a follower lost ends the leader's run within PEER_LOST_WITHIN_S, a
# leader lost has each follower's tree gone within LEADER_LOST_KILL_WITHIN_S, of which detection may take
# DETECT_WITHIN_S (the rest is the SIGKILL and the reap).
PEER_LOST_WITHIN_S = 30.0
LEADER_LOST_KILL_WITHIN_S = 10.0
DETECT_WITHIN_S = 8.0
LEADER_CANARY_INTERVAL_S = 15.0
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
# A follower's own last line before the group forms (research 1.4): the worker's KV-cache line, logged only
# after the rendezvous.  vllm/v1/worker/cpu_worker.py; gpu_worker.py (info_once, local rank 0 of each node).
FOLLOWER_STARTED_PATTERNS = (r"\) GiB for KV cache on node \d+\.", r"Available KV cache memory: ")
FOLLOWER_GRACE_S = 2.0


def parse_cluster(t: Table, present: bool, role: Role, child: ChildConfig) -> ClusterConfig | None:
    """[cluster] exactly when the role is a group node; its rank agrees with the role (config/role_spec.py)."""
    ranks = role_spec.of(role).node_ranks
    if not present:
        if ranks is not None:
            raise t.error(
                "nnodes", f"deployment.role = {role.value!r} needs a [cluster] table (nnodes, node_rank, master_addr)"
            )
        return None
    if ranks is None:
        raise t.error(
            "nnodes",
            f"[cluster] is for a multi-node group, but deployment.role is {role.value!r}: "
            'set role = "leader" (node_rank 0) or "follower", or remove [cluster]',
        )
    nnodes = t.integer("nnodes", MISSING, minimum=2, maximum=1024)  # type: ignore[arg-type]
    node_rank = t.integer("node_rank", MISSING, minimum=0, maximum=1023)  # type: ignore[arg-type]
    if node_rank >= nnodes:
        raise t.error("node_rank", f"expected 0 <= node_rank < nnodes ({nnodes}), got {node_rank}")
    if not ranks[0] <= node_rank <= ranks[1]:
        want = role_spec.of(role).node_ranks_text
        raise t.error("node_rank", f"deployment.role is {role.value!r}, so node_rank must be {want}, got {node_rank}")
    addr = t.string("master_addr", MISSING) or ""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        if not _HOSTNAME.match(addr):
            raise t.error(
                "master_addr", f"expected the leader's IP address or host name, got {short_repr(addr)}"
            ) from None
    return _parse_endpoints(t, nnodes, node_rank, addr, child)


def _parse_endpoints(t: Table, nnodes: int, node_rank: int, addr: str, child: ChildConfig) -> ClusterConfig:
    """The rest of [cluster], once the node's place in the group is known: the status endpoints and the bounds."""
    status_port = t.integer("status_port", 29599, minimum=1, maximum=65535)
    # The status endpoint listens on this node's cluster address (its VLLM_HOST_IP) unless told otherwise.
    status_address = t.string("status_address", child.env.get("VLLM_HOST_IP", "127.0.0.1")) or ""
    try:
        ipaddress.ip_address(status_address)
    except ValueError:
        raise t.error(
            "status_address", f"expected an IP address of this node, got {short_repr(status_address)}"
        ) from None
    # Node 0 is the group's leader (vLLM's --node-rank), and the role agrees with the rank (checked above).
    leader = node_rank == 0
    host = f"[{addr}]" if ":" in addr else addr
    leader_url = t.string("leader_status_url", "" if leader else f"http://{host}:{status_port}/") or ""
    if leader and leader_url:
        raise t.error("leader_status_url", "is for a follower (it names its leader's status endpoint); remove it")
    if leader_url and not _STATUS_URL.match(leader_url):
        raise t.error("leader_status_url", f"expected an http:// URL, got {short_repr(leader_url)}")
    peers = _peers(t, leader, nnodes)
    cfg = ClusterConfig(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=t.integer("master_port", 29501, minimum=1, maximum=65535),
        status_address=status_address,
        status_port=status_port,
        leader_status_url=leader_url,
        peers=peers,
        probe_interval_s=t.number("probe_interval_s", 1.0, maximum=60),
        probe_timeout_s=t.number("probe_timeout_s", 1.0, maximum=60),
        failures_tolerated=t.integer("failures_tolerated", 3, minimum=1, maximum=100),
        leader_wait_s=t.number("leader_wait_s", 3600.0, maximum=7 * 86400),
        execute_model_timeout_s=t.integer(
            "execute_model_timeout_s", 20, minimum=1, maximum=int(PEER_LOST_WITHIN_S) - 1
        ),
    )
    if cfg.detect_within_s > DETECT_WITHIN_S:
        raise t.error(
            "failures_tolerated",
            f"failures_tolerated x (probe_interval_s + probe_timeout_s) = {cfg.detect_within_s:g}s, expected at most "
            f"{DETECT_WITHIN_S:g}s (a lost leader's tree must be gone within {LEADER_LOST_KILL_WITHIN_S:g}s)",
        )
    t.done()
    return cfg


def _peers(t: Table, leader: bool, nnodes: int) -> tuple[str, ...]:
    """The leader's: each follower's status URL; a follower watches only its leader."""
    peers = t.strings("peers", MISSING if leader else [])
    if not leader and peers:
        raise t.error("peers", "is for the leader (each follower's status URL); a follower watches only its leader")
    if leader:
        if len(peers) != nnodes - 1 or len(set(peers)) != len(peers):
            raise t.error(
                "peers", f"expected {nnodes - 1} distinct follower status URLs (nnodes - 1), got {len(peers)}"
            )
        for i, url in enumerate(peers):
            if not _STATUS_URL.match(url):
                raise t.error(f"peers[{i}]", f"expected an http:// URL, got {short_repr(url)}")
    return peers


@dataclasses.dataclass(frozen=True)
class GroupNode:
    """The tables a group node's [cluster] changes, as config/load.py passes them in and takes them back."""

    cluster: ClusterConfig
    child: ChildConfig
    readiness: ReadinessConfig
    liveness: LivenessConfig
    shutdown: ShutdownConfig


def apply_cluster(node: GroupNode, data: Mapping[str, Any], preflight: PreflightConfig, path: Path) -> GroupNode:
    """A leader's canary, the rank flags in child.argv, a follower's readiness and stop defaults."""
    liveness = node.liveness
    if node.cluster.node_rank == 0 and "canary_interval_s" not in data.get("liveness", {}):
        # A group's idle canary is what sees a wedged follower; 60 s (one node's default) is past the bound.
        liveness = dataclasses.replace(liveness, canary_interval_s=LEADER_CANARY_INTERVAL_S)
    cluster, child = _rank_flags(node.cluster, node.child, liveness, preflight, path)
    readiness, shutdown = node.readiness, node.shutdown
    if cluster.node_rank > 0:
        readiness, shutdown = _follower_defaults(data, readiness, shutdown, cluster)
    return GroupNode(cluster, child, readiness, liveness, shutdown)


def _follower_defaults(
    data: Mapping[str, Any], readiness: ReadinessConfig, shutdown: ShutdownConfig, cluster: ClusterConfig
) -> tuple[ReadinessConfig, ShutdownConfig]:
    """A follower has no API: it is ready on its own KV-cache line plus its leader's status, not on /health."""
    given_r, given_s = data.get("readiness", {}), data.get("shutdown", {})
    if "started_patterns" not in given_r:
        readiness = dataclasses.replace(
            readiness, started_patterns=tuple(re.compile(p) for p in FOLLOWER_STARTED_PATTERNS)
        )
    readiness = dataclasses.replace(readiness, health_url=cluster.leader_status_url)
    if "grace_s" not in given_s:
        # Its workers ignore SIGTERM while blocked on the leader's queue (vLLM's own stop takes 12 s and ends
        # in SIGKILL, research F5), and it serves no request of its own: a lost leader's tree goes in seconds.
        shutdown = dataclasses.replace(shutdown, grace_s=FOLLOWER_GRACE_S)
    return readiness, shutdown


def _rank_flags(
    cfg: ClusterConfig, child: ChildConfig, liveness: LivenessConfig, preflight: PreflightConfig, path: Path
) -> tuple[ClusterConfig, ChildConfig]:
    """The rank flags written into (or checked in) child.argv, vLLM's execute-model bound in its env."""
    try:
        group = group_argv(child.argv, cfg, headless=cfg.node_rank > 0)
    except RankFlagError as exc:
        raise ConfigError(f"{path}: child.argv: {exc.flag}: {exc}") from None
    if preflight.gpus and len(preflight.gpus) < group.local_world_size:
        raise ConfigError(
            f"{path}: preflight.gpus: {len(preflight.gpus)} GPUs, but this node's share of the group needs "
            f"{group.local_world_size} (world size {group.world_size} / nnodes {cfg.nnodes})"
        )
    if cfg.node_rank == 0 and liveness.canary_interval_s == 0:
        raise ConfigError(
            f"{path}: liveness.canary_interval_s: 0 (off), but a leader needs its canary: /health stays 200 with a "
            "dead or wedged follower until a request hangs (docs/multi-node.md)"
        )
    env = dict(child.env)
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(cfg.execute_model_timeout_s))
    # Published on the status endpoint: over the redacted argv, so no guess at a secret (`--api-key X`) can be
    # checked against it offline; every node redacts alike, so the digests still agree.
    digest = hashlib.sha256("\0".join(redact_argv(strip_rank_flags(group.argv))).encode()).hexdigest()
    cfg = dataclasses.replace(cfg, local_world_size=group.local_world_size, argv_digest=digest)
    return cfg, dataclasses.replace(child, argv=group.argv, env=env)
