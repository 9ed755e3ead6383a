"""[deployment] and [cluster]: the role this supervisor's child plays, and the tables its config may have, checked once
when the config is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_supervisor.config import role_spec
from kimi_supervisor.config.load import effective_config
from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.roles import Role
from tests.config.config_text import error_of, load

MINIMAL = '[child]\nargv = ["vllm", "serve", "/m"]\n'
LEADER = (
    '[child]\nargv = ["vllm", "serve", "/m", "-tp", "2"]\n'
    + '[deployment]\nrole = "leader"\n[cluster]\nnnodes = 2\nnode_rank = 0\nmaster_addr = "10.77.0.1"\n'
    + 'peers = ["http://10.77.0.2:29599/"]\n'
)


def test_defaults_one_engine_named_after_its_file(tmp_path: Path) -> None:
    cfg = load(tmp_path, MINIMAL, "kimi-a.toml")
    assert (cfg.deployment.name, cfg.role, cfg.cluster) == ("kimi-a", Role.ENGINE, None)
    assert cfg.role.serves_api and not cfg.role.in_group


def test_leader_and_follower(tmp_path: Path) -> None:
    cfg = load(tmp_path, LEADER + "master_port = 29771\n")
    assert cfg.role is Role.LEADER and cfg.cluster is not None
    c = cfg.cluster
    assert ClusterConfig(c.nnodes, c.node_rank, c.master_addr, c.master_port) == ClusterConfig(2, 0, "10.77.0.1", 29771)
    follower = LEADER.replace('"leader"', '"follower"').replace("node_rank = 0", "node_rank = 1")
    follower = follower.replace('peers = ["http://10.77.0.2:29599/"]\n', "")
    cfg = load(tmp_path, follower)
    assert cfg.role is Role.FOLLOWER and not cfg.role.serves_api and cfg.cluster is not None
    assert cfg.cluster.master_port == 29501  # vLLM's documented example port
    assert effective_config(cfg)["deployment"] == {"name": "k", "role": "follower"}


def test_weights_role(tmp_path: Path) -> None:
    preload = '[child]\nargv = ["vllm", "preload", "--model", "/m"]\n'
    cfg = load(tmp_path, preload + '[deployment]\nname = "kimi"\nrole = "weights"\n')
    assert (cfg.deployment.name, cfg.role) == ("kimi", Role.WEIGHTS) and not cfg.role.serves_api


@pytest.mark.parametrize(
    ("file", "text", "role"),
    [
        ("kimi-a.front.toml", '[deployment]\nrole = "front"\n[front]\nport = 8123\n', Role.FRONT),
        (
            "kimi-a.weights.toml",
            '[child]\nargv = ["vllm", "preload", "--model", "/m"]\n[deployment]\nrole = "weights"\n',
            Role.WEIGHTS,
        ),
        # Another role's suffix stays part of the name: an engine's file is named after it whole.
        ("kimi-a.front.toml", MINIMAL, Role.ENGINE),
    ],
    ids=["front", "weights", "engine"],
)
def test_a_roles_config_without_a_name_is_its_deployments_named_without_the_roles_suffix(
    tmp_path: Path, file: str, text: str, role: Role
) -> None:
    """kimi-supervisor-front@NAME runs NAME.front.toml, kimi-supervisor-weights@NAME NAME.weights.toml: both are
    deployment NAME's (was: deployment 'NAME.front', whose socket, state and locks no engine of NAME shares)."""
    cfg = load(tmp_path, text, file)
    expected = "kimi-a.front" if role is Role.ENGINE else "kimi-a"
    assert (cfg.deployment.name, cfg.role) == (expected, role)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            MINIMAL + '[deployment]\nrole = "head"\n',
            "{p}: deployment.role: expected one of 'engine', 'leader', 'follower', 'weights', 'front', 'spare', "
            "got 'head'",
        ),
        (
            MINIMAL + '[deployment]\nname = "../etc"\n',
            "{p}: deployment.name: expected letters, digits, '_', '.' or '-' (at most 64, not starting with a sign), "
            "got '../etc'",
        ),
        (
            MINIMAL + '[deployment]\nrole = "leader"\n',
            "{p}: cluster.nnodes: deployment.role = 'leader' needs a [cluster] table (nnodes, node_rank, master_addr)",
        ),
        (
            MINIMAL + "[cluster]\nnnodes = 2\nnode_rank = 0\nmaster_addr = 'a'\n",
            "{p}: cluster.nnodes: [cluster] is for a multi-node group, but deployment.role is 'engine': "
            'set role = "leader" (node_rank 0) or "follower", or remove [cluster]',
        ),
        (
            LEADER.replace("node_rank = 0", "node_rank = 1"),
            "{p}: cluster.node_rank: deployment.role is 'leader', so node_rank must be 0 (the leader), got 1",
        ),
        (
            LEADER.replace('"leader"', '"follower"'),
            "{p}: cluster.node_rank: deployment.role is 'follower', so node_rank must be 1 or more (a follower), got 0",
        ),
        (
            LEADER.replace("node_rank = 0", "node_rank = 2").replace('"leader"', '"follower"'),
            "{p}: cluster.node_rank: expected 0 <= node_rank < nnodes (2), got 2",
        ),
        (
            LEADER.replace("nnodes = 2", "nnodes = 1"),
            "{p}: cluster.nnodes: expected an integer between 2 and 1024, got 1",
        ),
        (
            LEADER.replace('"10.77.0.1"', '"10.0.0.1; rm -rf /"'),
            "{p}: cluster.master_addr: expected the leader's IP address or host name, got '10.0.0.1; rm -rf /'",
        ),
        (LEADER.replace('master_addr = "10.77.0.1"\n', ""), "{p}: cluster.master_addr: required key is missing"),
        (LEADER + "master_port = 0\n", "{p}: cluster.master_port: expected an integer between 1 and 65535, got 0"),
        (LEADER + "rank = 1\n", "{p}: cluster.rank: unknown key"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, expected: str) -> None:
    message = error_of(tmp_path, text)
    assert message.startswith(expected), message


def test_a_file_name_that_cannot_name_the_deployment(tmp_path: Path) -> None:
    message = error_of(tmp_path, MINIMAL, "-odd name.toml")
    assert message == (
        "{p}: deployment.name: the config file's name '-odd name' cannot name the deployment "
        "(letters, digits, '_', '.', '-'; at most 64): set deployment.name"
    )
    assert load(tmp_path, MINIMAL + '[deployment]\nname = "odd"\n', "-odd name.toml").deployment.name == "odd"


@pytest.mark.parametrize("addr", ["10.77.0.1", "fd00::1", "leader-0.cluster.internal"])
def test_master_addr_forms(tmp_path: Path, addr: str) -> None:
    cfg = load(tmp_path, LEADER.replace('"10.77.0.1"', f'"{addr}"'))
    assert cfg.cluster is not None and cfg.cluster.master_addr == addr


FRONT = '[deployment]\nrole = "front"\n[front]\nport = 8123\n'
# Every table of a supervised child's config but [child], which has its own words (below); written here, not read
# from config/role_spec.py, so that a row that lost one fails here.
CHILD_ONLY = (
    "preflight",
    "readiness",
    "health",
    "shutdown",
    "metrics",
    "liveness",
    "gpu_health",
    "cluster",
    "readahead",
    "weights",
)


@pytest.mark.parametrize("table", [*CHILD_ONLY, "preflight.reap"])
def test_a_fronts_config_with_a_child_only_table_is_refused_naming_it(tmp_path: Path, table: str) -> None:
    """A front has no child (docs/front.md): its engine's settings in the front's file would be read and mean
    nothing (was: accepted silently)."""
    top = table.split(".")[0]
    assert error_of(tmp_path, FRONT + f"[{table}]\nenabled = true\n", "kimi-a.front.toml") == (
        f"{{p}}: {top}: deployment.role = 'front' does not read [{top}] (its config has [deployment], [front], "
        "[paths]): remove it"
    )


def test_the_child_only_tables_are_the_role_specs() -> None:
    assert set(CHILD_ONLY) | {"child"} == role_spec.CHILD_TABLES
    assert role_spec.of(Role.FRONT).tables == {"deployment", "front", "paths"}


@pytest.mark.parametrize("role", list(Role))
def test_each_rows_child_and_front_flags_agree_with_its_tables(role: Role) -> None:
    """has_child and reads_front say, in their own words, what the row's `tables` says of [child] and [front]
    (role_spec.py is values only, so neither is derived there): a row where they disagree would refuse a table
    its parse reads, or read one it refuses."""
    spec = role_spec.of(role)
    # A spare's child is its engine's: it spawns one, but its [child] is refused (config/spare.py), its [spare] read.
    assert (spec.has_child and not spec.child_of_engine) == ("child" in spec.tables)
    assert spec.reads_front == ("front" in spec.tables)
    assert spec.child_of_engine == ("spare" in spec.tables)


def test_a_fronts_child_table_keeps_its_own_words_and_its_allowed_tables_are_read(tmp_path: Path) -> None:
    assert error_of(tmp_path, FRONT + '[child]\nargv = ["vllm"]\n', "kimi-a.front.toml") == (
        "{p}: child: deployment.role = 'front' runs no child (docs/front.md): remove [child]"
    )
    paths = f'[paths]\nruntime_directory = "{tmp_path}/run"\nstate_directory = "{tmp_path}/state"\n'
    cfg = load(tmp_path, FRONT + paths, "kimi-a.front.toml")
    assert cfg.role is Role.FRONT and cfg.front is not None and cfg.front.port == 8123
    assert cfg.paths.runtime_directory == tmp_path / "run"
