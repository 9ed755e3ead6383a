"""The README documents every config key and every exit code, and its commands are the real ones."""

from __future__ import annotations

import re
from pathlib import Path

from kimi_supervisor.config.load import effective_config, parse_config
from kimi_supervisor.exitcodes import ExitCode

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def flat_keys(data: object, prefix: str = "") -> set[str]:
    if isinstance(data, dict) and prefix != "child.env.":
        return set().union(*(flat_keys(v, f"{prefix}{k}.") for k, v in data.items()))
    return {prefix.rstrip(".")}


def test_every_config_key_is_documented() -> None:
    cfg = parse_config({"child": {"argv": ["vllm"]}}, Path("x.toml"))
    keys = {k for k in flat_keys(effective_config(cfg)) if k != "path" and not k.startswith("child.vllm")}
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", README, re.MULTILINE))
    assert keys == documented


def test_every_exit_code_is_documented() -> None:
    rows = {int(m) for m in re.findall(r"^\| +(\d+) \|", README, re.MULTILINE)}
    assert rows == {int(c) for c in ExitCode}


def test_first_lines_give_the_two_commands() -> None:
    block = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("python3 -m pip install . && kimi-supervisor --dry-run")
    assert block[1].startswith("bash .ci/setup && python3 -m pytest -q")
    assert "bash .ci/setup && python3 -m pytest -q" in (REPO / ".ci" / "run").read_text()


def test_every_test_the_readme_names_exists() -> None:
    # Test files move (tests/preflight/ mirrors kimi_supervisor/preflight/): a stale node id in the fault
    # matrix would point a reader at nothing.
    named = set(re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", README))
    assert len(named) > 40
    missing = []
    for path, name in sorted(named):
        source = (REPO / path).read_text() if (REPO / path).is_file() else None
        if source is None or (name and not re.search(rf"^\s*(?:def|class) {name}\b", source, re.MULTILINE)):
            missing.append(f"{path}::{name}" if name else path)
    assert missing == []
