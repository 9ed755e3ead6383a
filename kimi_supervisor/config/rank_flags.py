"""The rank flags of a multi-node node's `vllm serve` argv: written from `[cluster]`, or checked against it.

vLLM's mp executor spreads one deployment over `--nnodes` hosts from the same argv on each, told apart only by
`--node-rank`, `--headless` and the node's `VLLM_HOST_IP` (vllm/engine/arg_utils.py, vllm/entrypoints/cli/
serve.py).  A node whose flags disagree with its `[cluster]` table would join another rendezvous, or none, and
hang there silently for the whole rendezvous window: so a flag already in argv must say what `[cluster]` says
(else ConfigError naming the flag), and a missing one is appended.  Prefix abbreviations, which argparse
accepts (`--node-r 1`), are refused: a flag this module does not see it cannot check.
"""

from __future__ import annotations

import dataclasses
import re

from kimi_supervisor.config.model import ClusterConfig

# vLLM's name for each flag, its short alias (vllm/engine/arg_utils.py), and the config key it comes from.
_VALUED = {
    "--nnodes": ("-n", "nnodes"),
    "--node-rank": ("-r", "node_rank"),
    "--master-addr": (None, "master_addr"),
    "--master-port": (None, "master_port"),
    "--distributed-executor-backend": (None, None),
}
_HEADLESS = "--headless"
_BACKEND = "mp"  # the one executor with native multi-node; Ray is out of scope (docs/multi-node.md)
# The sizes whose product is vLLM's world size (DP x PP x TP; PCP is 1 unless set, and refused here).
_SIZES = {
    "--tensor-parallel-size": "-tp",
    "--pipeline-parallel-size": "-pp",
    "--data-parallel-size": "-dp",
}
# What vLLM logs as `api_server` is the frontend module: with --headless it starts an API server anyway and
# the follower dies in `collective_rpc should not be called on follower node` (vllm-project/vllm #33910).
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class RankFlagError(ValueError):
    """`flag` in child.argv disagrees with [cluster]; the message says what it is and what it must be."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclasses.dataclass(frozen=True)
class GroupArgv:
    argv: tuple[str, ...]
    added: tuple[str, ...]  # the flags this module appended (the dry run names them)
    world_size: int  # DP x PP x TP over the whole group
    local_world_size: int  # the GPUs each node must have: world_size / nnodes


def _expected(cluster: ClusterConfig, headless: bool) -> dict[str, str]:
    return {
        "--nnodes": str(cluster.nnodes),
        "--node-rank": str(cluster.node_rank),
        "--master-addr": cluster.master_addr,
        "--master-port": str(cluster.master_port),
        "--distributed-executor-backend": _BACKEND,
    } | ({_HEADLESS: ""} if headless else {})


def _canonical(arg: str) -> tuple[str | None, str | None]:
    """(vLLM flag name, inline value) for a rank or size flag in any of argparse's spellings, else (None, None)."""
    name, eq, inline = arg.partition("=")
    value = inline if eq else None
    for flag, (short, _key) in _VALUED.items():
        if name == flag or (short is not None and name == short):
            return flag, value
        if short is not None and re.fullmatch(re.escape(short) + r"\d+", arg):
            return flag, arg[len(short) :]  # "-r1": argparse's attached short value
    for flag, short in _SIZES.items():
        if name in (flag, short):
            return flag, value
    if name in (_HEADLESS, "--no-headless"):
        return name, value
    if name.startswith("--") and len(name) > 3:
        for flag in (*_VALUED, *_SIZES, _HEADLESS):
            if flag.startswith(name):
                raise RankFlagError(
                    flag, f"{name} abbreviates {flag}: spell it out (the supervisor checks it against [cluster])"
                )
    return None, None


def group_argv(argv: tuple[str, ...], cluster: ClusterConfig, headless: bool) -> GroupArgv:
    """argv with every rank flag present and agreeing with `cluster`; RankFlagError names the first that is not."""
    expected = _expected(cluster, headless)
    found: dict[str, str] = {}
    sizes: dict[str, int] = {}
    i = 1
    while i < len(argv):
        flag, value = _canonical(argv[i])
        if flag is None:
            i += 1
            continue
        if flag in (_HEADLESS, "--no-headless"):
            if value is not None:
                raise RankFlagError(_HEADLESS, f"{argv[i]}: --headless takes no value")
            found[_HEADLESS] = "" if flag == _HEADLESS else "no"
            i += 1
            continue
        if value is None:
            if i + 1 >= len(argv):
                raise RankFlagError(flag, f"{flag} has no value")
            value = argv[i + 1]
            i += 1
        i += 1
        if flag in _SIZES:
            try:
                sizes[flag] = int(value)
            except ValueError:
                raise RankFlagError(flag, f"{flag} expects an integer, got {value!r}") from None
            if sizes[flag] < 1:
                raise RankFlagError(flag, f"{flag} expects >= 1, got {value}")
            continue
        if flag in found and found[flag] != value:
            raise RankFlagError(flag, f"{flag} is given twice ({found[flag]!r} and {value!r})")
        found[flag] = value
    for flag, want in expected.items():
        have = found.get(flag)
        if have is not None and have != want:
            raise RankFlagError(flag, _disagreement(flag, have, want, cluster))
    if not headless and found.get(_HEADLESS) == "":
        raise RankFlagError(
            _HEADLESS, f"{_HEADLESS} is for a follower, but node_rank is 0 (the leader serves the API): remove it"
        )
    if headless and any(_API_SERVER_MODULE in a for a in argv):
        raise RankFlagError(
            _HEADLESS,
            f"a follower must run `vllm serve ... --headless`: `python -m {_API_SERVER_MODULE}` ignores --headless "
            "(vllm-project/vllm issue #33910)",
        )
    added: list[str] = []
    for flag, want in expected.items():
        if flag not in found:
            added.extend([flag] if flag == _HEADLESS else [flag, want])
    tp = sizes.get("--tensor-parallel-size", 1)
    pp = sizes.get("--pipeline-parallel-size", 1)
    dp = sizes.get("--data-parallel-size", 1)
    world = tp * pp * dp
    if world % cluster.nnodes:
        raise RankFlagError(
            "--tensor-parallel-size",
            f"the world size (TP {tp} x PP {pp} x DP {dp} = {world}) is not divisible by nnodes ({cluster.nnodes}): "
            "vLLM gives each node world_size / nnodes GPUs",
        )
    return GroupArgv(argv + tuple(added), tuple(added), world, world // cluster.nnodes)


def _disagreement(flag: str, have: str, want: str, cluster: ClusterConfig) -> str:
    if flag == _HEADLESS:
        return "--no-headless on a follower: a follower (node_rank >= 1) runs --headless"
    if flag == "--distributed-executor-backend":
        return f"{flag} {have}: a multi-node group runs on vLLM's own mp executor, expected {want}"
    key = _VALUED[flag][1]
    return f"{flag} {have} disagrees with cluster.{key} = {want!r}: remove it from argv or make them agree"


def strip_rank_flags(argv: tuple[str, ...]) -> tuple[str, ...]:
    """argv without the flags that differ between nodes of one group: what must be identical on every node."""
    out: list[str] = []
    i = 1
    while i < len(argv):
        flag, value = _canonical(argv[i])
        if flag in _VALUED:
            i += 1 if value is not None else 2
            continue
        if flag in (_HEADLESS, "--no-headless"):
            i += 1
            continue
        out.append(argv[i])
        i += 1
    return (argv[0], *out) if argv else ()
