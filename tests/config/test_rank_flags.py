"""The rank flags in child.argv, written from [cluster] or checked against it; the group's bounds in the config."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.config.rank_flags import RankFlagError, group_argv, strip_rank_flags
from kimi_supervisor.redact import REDACTED
from tests.config.config_text import error_of, load

CLUSTER = ClusterConfig(2, 1, "10.77.0.1", 29771)
BASE = ("vllm", "serve", "/m", "--tensor-parallel-size", "2")


def config(argv: str = '"vllm", "serve", "/m", "-tp", "2"', rank: int = 1, extra: str = "", child: str = "") -> str:
    role = "leader" if rank == 0 else "follower"
    peers = 'peers = ["http://10.77.0.2:29599/"]\n' if rank == 0 else ""
    return (
        f"[child]\nargv = [{argv}]\n{child}[deployment]\nrole = {role!r}\n"
        f'[cluster]\nnnodes = 2\nnode_rank = {rank}\nmaster_addr = "10.77.0.1"\nmaster_port = 29771\n{peers}{extra}'
    ).replace("'", '"')


def test_follower_flags_are_appended() -> None:
    group = group_argv(BASE, CLUSTER, headless=True)
    assert group.argv == (
        *BASE,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.77.0.1",
        "--master-port",
        "29771",
        "--distributed-executor-backend",
        "mp",
        "--headless",
    )
    assert (group.world_size, group.local_world_size) == (2, 1)


def test_leader_gets_no_headless_and_agreeing_flags_are_kept() -> None:
    leader = ClusterConfig(2, 0, "10.77.0.1", 29771)
    argv = (*BASE, "--nnodes=2", "-r0", "--master-addr", "10.77.0.1", "--pipeline-parallel-size", "2")
    group = group_argv(argv, leader, headless=False)
    assert "--headless" not in group.argv and group.argv[: len(argv)] == argv
    assert group.added == ("--master-port", "29771", "--distributed-executor-backend", "mp")
    assert (group.world_size, group.local_world_size) == (4, 2)


@pytest.mark.parametrize(
    ("extra", "headless", "flag", "words"),
    [
        (("--node-rank", "2"), True, "--node-rank", "--node-rank 2 disagrees with cluster.node_rank = '1'"),
        (("-n", "4"), True, "--nnodes", "--nnodes 4 disagrees with cluster.nnodes = '2'"),
        (("--master-addr=10.0.0.9",), True, "--master-addr", "disagrees with cluster.master_addr"),
        (("--master-port", "29501"), True, "--master-port", "disagrees with cluster.master_port = '29771'"),
        (("--distributed-executor-backend", "ray"), True, "--distributed-executor-backend", "expected mp"),
        (("--headless",), False, "--headless", "is for a follower"),
        (("--no-headless",), True, "--headless", "a follower (node_rank >= 1) runs --headless"),
        (("--node-r", "1"), True, "--node-rank", "--node-r abbreviates --node-rank"),
        (("--node-rank", "1", "--node-rank", "2"), True, "--node-rank", "given twice"),
        (("--master-port",), True, "--master-port", "has no value"),
        (("-tp", "3"), True, "--tensor-parallel-size", "(TP 3 x PP 1 x DP 1 = 3) is not divisible by nnodes (2)"),
    ],
)
def test_inconsistent_flags_name_the_flag(extra: tuple[str, ...], headless: bool, flag: str, words: str) -> None:
    cluster = CLUSTER if headless else ClusterConfig(2, 0, "10.77.0.1", 29771)
    with pytest.raises(RankFlagError) as info:
        group_argv((*BASE, *extra), cluster, headless=headless)
    assert info.value.flag == flag and words in str(info.value)


def test_a_follower_refuses_the_api_server_module() -> None:
    argv = ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "-tp", "2")
    with pytest.raises(RankFlagError, match="ignores --headless"):
        group_argv(argv, CLUSTER, headless=True)


def test_digest_part_is_the_same_on_every_node() -> None:
    leader = group_argv(BASE, ClusterConfig(2, 0, "10.77.0.1", 29771), headless=False).argv
    follower = group_argv(BASE, CLUSTER, headless=True).argv
    assert strip_rank_flags(leader) == strip_rank_flags(follower) == BASE
    assert strip_rank_flags((*BASE, "--port", "8001")) != strip_rank_flags(BASE)


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
