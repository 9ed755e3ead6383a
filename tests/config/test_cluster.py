"""[cluster] (config/cluster.py): the group's bounds, the rank flags it writes into child.argv, a leader's canary and
a follower's readiness and stop defaults, as the config is built."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kimi_supervisor.config.cluster import FOLLOWER_GRACE_S, FOLLOWER_STARTED_PATTERNS, LEADER_CANARY_INTERVAL_S
from kimi_supervisor.redact import REDACTED
from tests.config.config_text import error_of, load


def config(argv: str = '"vllm", "serve", "/m", "-tp", "2"', rank: int = 1, extra: str = "", child: str = "") -> str:
    role = "leader" if rank == 0 else "follower"
    peers = 'peers = ["http://10.77.0.2:29599/"]\n' if rank == 0 else ""
    return (
        f"[child]\nargv = [{argv}]\n{child}[deployment]\nrole = {role!r}\n"
        f'[cluster]\nnnodes = 2\nnode_rank = {rank}\nmaster_addr = "10.77.0.1"\nmaster_port = 29771\n{peers}{extra}'
    ).replace("'", '"')


def test_config_writes_flags_env_and_digest(tmp_path: Path) -> None:
    cfg = load(tmp_path, config())
    assert cfg.child.argv[-1] == "--headless" and "--node-rank" in cfg.child.argv
    assert cfg.child.env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "20"
    assert cfg.cluster is not None and cfg.cluster.leader_status_url == "http://10.77.0.1:29599/"
    leader = load(tmp_path, config(rank=0))
    assert leader.cluster is not None and leader.cluster.argv_digest == cfg.cluster.argv_digest
    assert leader.liveness.canary_interval_s == 15.0  # a leader's canary default, not one node's 60 s


def test_the_published_digest_is_over_the_redacted_argv_and_agrees_across_nodes(tmp_path: Path) -> None:
    """Was (docs/multi-node.md): the status endpoint's digest was of argv with `--api-key`: a guess at the key could
    be checked offline against it.  Now it is over the argv as redact_argv shows it, on every node alike."""
    secret_argv = (
        '"vllm", "serve", "/m", "-tp", "2", "--api-key", "{a}", "--hf-token={b}", "--max-num-batched-tokens", "64"'
    )
    one = load(tmp_path, config(argv=secret_argv.format(a="sk-first-key", b="hf_first")))
    two = load(tmp_path, config(argv=secret_argv.format(a="sk-other-key", b="hf_other"), rank=0))
    assert one.cluster is not None and two.cluster is not None
    assert one.cluster.argv_digest == two.cluster.argv_digest  # the secrets differ; the group still agrees
    shown = ["vllm", "serve", "/m", "-tp", "2", "--api-key", REDACTED, f"--hf-token={REDACTED}"]
    shown += ["--max-num-batched-tokens", "64"]
    assert one.cluster.argv_digest == hashlib.sha256("\0".join(shown).encode()).hexdigest()
    # Anything else still counts: another token budget is another argv.
    three = load(tmp_path, config(argv=secret_argv.format(a="sk-first-key", b="hf_first").replace("64", "128")))
    assert three.cluster is not None and three.cluster.argv_digest != one.cluster.argv_digest


def test_configured_execute_model_timeout_is_kept(tmp_path: Path) -> None:
    cfg = load(
        tmp_path, config(child='env = { VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS = "25", VLLM_HOST_IP = "10.77.0.2" }\n')
    )
    assert cfg.child.env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "25"
    assert cfg.cluster is not None and cfg.cluster.status_address == "10.77.0.2"  # its cluster address


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            config(argv='"vllm", "serve", "/m", "-tp", "2", "--node-rank", "0"'),
            "{p}: child.argv: --node-rank: --node-rank 0 disagrees with cluster.node_rank = '1': "
            "remove it from argv or make them agree",
        ),
        (
            config(rank=0, extra="[preflight]\ngpus = [0]\n", argv='"vllm", "serve", "/m", "-tp", "4"'),
            "{p}: preflight.gpus: 1 GPUs, but this node's share of the group needs 2 (world size 4 / nnodes 2)",
        ),
        (
            config(rank=0) + "[liveness]\ncanary_interval_s = 0\n",
            "{p}: liveness.canary_interval_s: 0 (off), but a leader needs its canary: /health stays 200 with a dead "
            "or wedged follower until a request hangs (docs/multi-node.md)",
        ),
        (
            config(extra="failures_tolerated = 5\n"),
            "{p}: cluster.failures_tolerated: failures_tolerated x (probe_interval_s + probe_timeout_s) = 10s, "
            "expected at most 8s (a lost leader's tree must be gone within 10s)",
        ),
        (
            config(extra="execute_model_timeout_s = 30\n"),
            "{p}: cluster.execute_model_timeout_s: expected an integer between 1 and 29, got 30",
        ),
        (
            config(rank=0).replace('peers = ["http://10.77.0.2:29599/"]\n', "peers = []\n"),
            "{p}: cluster.peers: expected 1 distinct follower status URLs (nnodes - 1), got 0",
        ),
        (
            config(extra='peers = ["http://10.77.0.3:29599/"]\n'),
            "{p}: cluster.peers: is for the leader (each follower's status URL); a follower watches only its leader",
        ),
        (
            config(rank=0, extra='leader_status_url = "http://x/"\n'),
            "{p}: cluster.leader_status_url: is for a follower (it names its leader's status endpoint); remove it",
        ),
        (
            config(extra='status_address = "eth0"\n'),
            "{p}: cluster.status_address: expected an IP address of this node, got 'eth0'",
        ),
    ],
)
def test_group_config_errors(tmp_path: Path, text: str, expected: str) -> None:
    assert error_of(tmp_path, text) == expected


def test_a_follower_is_ready_on_its_kv_cache_line_and_its_leaders_status_and_stops_fast(tmp_path: Path) -> None:
    cfg = load(tmp_path, config())
    assert [p.pattern for p in cfg.readiness.started_patterns] == list(FOLLOWER_STARTED_PATTERNS)
    assert cfg.readiness.health_url == "http://10.77.0.1:29599/"  # its leader's status, not a /health of its own
    assert cfg.shutdown.grace_s == FOLLOWER_GRACE_S
    given = load(tmp_path, config() + '[readiness]\nstarted_patterns = ["up"]\n[shutdown]\ngrace_s = 9\n')
    assert [p.pattern for p in given.readiness.started_patterns] == ["up"] and given.shutdown.grace_s == 9
    leader = load(tmp_path, config(rank=0))
    assert leader.liveness.canary_interval_s == LEADER_CANARY_INTERVAL_S and leader.shutdown.grace_s == 30.0
