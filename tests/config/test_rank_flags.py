"""The rank flags in child.argv, written from [cluster] or checked against it (config/rank_flags.py); the config's side,
the group's bounds included, is tests/config/test_cluster.py's."""

from __future__ import annotations

import pytest

from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.config.rank_flags import RankFlagError, group_argv, strip_rank_flags

CLUSTER = ClusterConfig(2, 1, "10.77.0.1", 29771)
BASE = ("vllm", "serve", "/m", "--tensor-parallel-size", "2")


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
