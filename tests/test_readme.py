"""README and docs/ document every config key and every exit code, its commands are the real ones, and every test
they name exists."""

from __future__ import annotations

import re
from pathlib import Path

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.config.load import effective_config, parse_config
from kimi_supervisor.exitcodes import ExitCode

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
PAGES = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
CONFIGURATION = PAGES["configuration.md"]
FAULT_MATRIX = PAGES["fault-matrix.md"]


def flat_keys(data: object, prefix: str = "") -> set[str]:
    if isinstance(data, dict) and prefix not in ("child.env.", "child.credentials."):
        return set().union(*(flat_keys(v, f"{prefix}{k}.") for k, v in data.items()))
    return {prefix.rstrip(".")}


def test_every_config_key_is_documented() -> None:
    # A group node's config: [cluster] is absent (None) from a one-node config, so its keys would not show.
    group = {"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.1", "peers": ["http://10.0.0.2:29599/"]}
    cfg = parse_config(
        {"child": {"argv": ["vllm", "-tp", "2"]}, "deployment": {"role": "leader"}, "cluster": group}, Path("x.toml")
    )
    # child.vllm is parsed from child.argv; child.cache_directory is paths.cache_directory, handed to the spawn.
    # weights: None here; its table's keys (the holder's and the engine's: config/load.py _parse_weights) are
    # these, the rest of WeightsConfig is derived (the socket dir from [paths], the key from child.argv).
    # front: None here; its keys are a front's [front] (config/front.py), less what it derives from [paths].
    derived = ("child.vllm", "child.cache_directory", "weights", "front")
    keys = {k for k in flat_keys(effective_config(cfg)) if k != "path" and not k.startswith(derived)}
    keys |= {"weights.holder", "weights.wait_s", "weights.health_port"}
    keys |= {f"front.{f}" for f in FrontConfig.__dataclass_fields__} - {
        "front.deployment",
        "front.engine_socket",
        "front.engine_state_file",
        "front.engine_history_file",
        "front.engine_holder_state_file",
        "front.state_file",
    }
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", CONFIGURATION, re.MULTILINE))
    assert keys == documented


def test_every_exit_code_is_documented() -> None:
    rows = {int(m) for m in re.findall(r"^\| +(\d+) \|", README, re.MULTILINE)}
    assert rows == {int(c) for c in ExitCode}


def test_first_lines_give_the_two_commands() -> None:
    block = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    # A venv of its own: PEP 668 hosts (Debian 12, Ubuntu 24.04) refuse `pip install` into the system's python,
    # and install-unit writes the executable it runs from (tests/systemd/test_install_venv.py).
    venv = "/opt/kimi-supervisor"
    assert block[0].startswith(
        f"python3 -m venv {venv} && {venv}/bin/pip install . && {venv}/bin/kimi-supervisor --dry-run"
    )
    assert "python3 -m pip" not in block[0]
    assert block[1].startswith("bash .ci/setup && python3 -m pytest -q")
    assert "bash .ci/setup && python3 -m pytest -q" in (REPO / ".ci" / "run").read_text()


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves() -> None:
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
    assert linked == set(PAGES)
    for name, text in PAGES.items():
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", text):
            assert (DOCS / target).resolve().is_file(), f"docs/{name} links to {target}"


def test_every_fault_matrix_row_names_a_test() -> None:
    rows = [line for line in FAULT_MATRIX.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) > 40
    # "same": the row above's test covers this one too.
    untested = [row for row in rows if not re.search(r"tests/|gpuaccept/|bench row|\| same \|$", row)]
    assert untested == []


def test_every_test_the_readme_names_exists() -> None:
    # Test files move (tests/<subpackage>/ mirrors kimi_supervisor/<subpackage>/): a stale node id in the
    # fault matrix or any page would point a reader at nothing.
    text = "\n".join([README, *PAGES.values()])
    named = set(re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", text))
    assert len(set(re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", FAULT_MATRIX))) > 40
    missing = []
    for path, name in sorted(named):
        source = (REPO / path).read_text() if (REPO / path).is_file() else None
        if source is None or (name and not re.search(rf"^\s*(?:def|class) {name}\b", source, re.MULTILINE)):
            missing.append(f"{path}::{name}" if name else path)
    assert missing == []
