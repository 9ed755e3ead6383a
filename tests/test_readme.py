"""README and docs/ document every config key and every exit code, its commands are the real ones, and every test
they name exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.config.load import effective_config, parse_config
from kimi_supervisor.exitcodes import ExitCode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
PAGES = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
# Pages in docs/'s folders (docs/fault-matrix/<area>.md, docs/history/): linked from a page above them, not the README.
SUBPAGES = {p.relative_to(DOCS).as_posix(): p.read_text() for p in sorted(DOCS.glob("*/**/*.md"))}
CONFIGURATION = PAGES["configuration.md"]
# The fault matrix: docs/fault-matrix.md is the index of its areas, one page each under docs/fault-matrix/.
FAULT_AREAS = {name: text for name, text in SUBPAGES.items() if name.startswith("fault-matrix/")}
FAULT_MATRIX = "\n".join(FAULT_AREAS.values())


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
    # spare: None here; its keys are a spare's [spare] (config/spare.py), less what it derives from its engine.
    derived = ("child.vllm", "child.cache_directory", "weights", "front", "spare")
    keys = {k for k in flat_keys(effective_config(cfg)) if k != "path" and not k.startswith(derived)}
    keys |= {"weights.holder", "weights.wait_s", "weights.health_port"}
    keys |= {f"front.{f}" for f in FrontConfig.__dataclass_fields__} - {
        "front.deployment",
        "front.engine_socket",
        "front.engine_state_file",
        "front.engine_history_file",
        "front.engine_holder_state_file",
        "front.state_file",
        "front.config_file",
        "front.spare_socket",
        "front.spare_state_file",
        "front.spare_history_file",
    }
    keys |= {"front.spare"} | {
        f"spare.{f}"
        for f in ("kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs", "overhead_mib", "margin_mib")
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


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", text)


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves() -> None:
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
    assert linked == set(PAGES)
    for name, text in {**PAGES, **SUBPAGES}.items():
        for target in links(text):
            assert (DOCS / name).parent.joinpath(target).resolve().is_file(), f"docs/{name} links to {target}"


def test_every_page_in_a_docs_folder_is_linked_from_a_page_of_docs() -> None:
    linked = {
        (DOCS / name).parent.joinpath(target).resolve().relative_to(DOCS.resolve()).as_posix()
        for name, text in {**PAGES, **SUBPAGES}.items()
        for target in links(text)
        if (DOCS / name).parent.joinpath(target).resolve().is_relative_to(DOCS.resolve())
    }
    assert set(SUBPAGES) <= linked, set(SUBPAGES) - linked
    # The index names every area, and an area page is nothing but the index's.
    index = set(re.findall(r"\]\((fault-matrix/[\w-]+\.md)\)", PAGES["fault-matrix.md"]))
    assert index == set(FAULT_AREAS)


# An entry names its test: a path under tests/ or gpuaccept/, a bench row, or "same" (the entry above's test).
TESTED = re.compile(r"^Test: (?:same$|.*?(?:tests/|gpuaccept/|bench row))", re.MULTILINE | re.DOTALL)


def fault_entries(page: str) -> list[str]:
    """The entries of a fault-matrix area page: `- **fault**: behaviour`, then the lines indented under it (the
    last of them `Test: ...`), one string each; anything else ends an entry."""
    entries: list[list[str]] = []
    current: list[str] | None = None
    for line in page.splitlines():
        if line.startswith("- **"):
            current = [line]
            entries.append(current)
        elif line.startswith("  ") and current is not None:
            current.append(line.strip())
        elif line.strip():
            current = None
    return ["\n".join(e) for e in entries]


def test_every_fault_matrix_entry_names_a_test() -> None:
    entries = [e for page in FAULT_AREAS.values() for e in fault_entries(page)]
    assert len(entries) > 200
    untested = [e.splitlines()[0] for e in entries if not TESTED.search(e)]
    assert untested == []


def test_every_fault_matrix_line_fits_a_screen() -> None:
    # Reference, not lab notes: an entry's behaviour and its tests wrap; a line of 1,600 characters was a table row.
    long = [
        f"docs/{name}:{n}"
        for name, text in FAULT_AREAS.items()
        for n, line in enumerate(text.splitlines(), 1)
        if len(line) > 200
    ]
    assert long == []


def test_the_fault_check_fails_on_an_entry_without_a_test() -> None:
    page = (
        "# x\n\nintro\n\n"
        "- **a fault**: what it does,\n  wrapped\n  Test: `tests/test_readme.py::fault_entries`\n\n"
        "- **the next**: the same\n  Test: same\n\n"
        "- **an untested one**: it says so\n  Test: by hand on the H200\n"
    )
    entries = fault_entries(page)
    assert len(entries) == 3
    assert [bool(TESTED.search(e)) for e in entries] == [True, True, False]


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


# -- the Layout table is the import-linter layers contract, in its order ----------------------------------------

LAYOUT_ROW = re.compile(r"^\| (?P<name>[^|]+?) \| +(?P<layer>\d+) \| (?P<what>.*) \|$")


def contract_layers(pyproject: str) -> list[list[str]]:
    """The layers contract of pyproject's `[tool.importlinter]`, top first: each layer's names under the package
    (`cli`, `exitcodes`), siblings split on `|` (independent) or `:`."""
    contracts = tomllib.loads(pyproject)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [[m.strip().removeprefix("kimi_supervisor.") for m in re.split(r"[|:]", layer)] for layer in layers]


def layout_rows(readme: str) -> list[tuple[int, list[str]]]:
    """The README's Layout table, in its order: (layer, the names it shows) per row; a subpackage's row is named
    `` `cli/` ``, a row of top-level modules names each as `` `exitcodes.py` `` in its text."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = LAYOUT_ROW.match(line)
        if m is None:
            continue
        package = re.fullmatch(r"`(\w+)/`", m["name"])
        names = [package[1]] if package else re.findall(r"`(\w+)\.py`", m["what"])
        rows.append((int(m["layer"]), names))
    return rows


def layout_problems(readme: str, pyproject: str) -> list[str]:
    layers = contract_layers(pyproject)
    want = {name: n for n, layer in enumerate(layers, 1) for name in layer}
    rows = layout_rows(readme)
    shown = {name: n for n, names in rows for name in names}
    problems = [
        f"{name}: layer {n} in the contract, not in the README's Layout"
        for name, n in want.items()
        if name not in shown
    ]
    problems += [
        f"{name}: layer {n} in the README's Layout, not in the contract"
        for name, n in shown.items()
        if name not in want
    ]
    problems += [
        f"{name}: layer {shown[name]} in the README's Layout, {n} in the contract"
        for name, n in want.items()
        if name in shown and shown[name] != n
    ]
    order = [n for n, _ in rows]
    if order != sorted(order):
        problems.append(f"the README's Layout rows are not in the contract's layer order: {order}")
    return problems


def test_the_readmes_layout_is_the_import_linter_layers_in_their_order() -> None:
    assert layout_problems(README, (REPO / "pyproject.toml").read_text()) == []


def test_every_subpackage_and_top_level_module_is_in_a_layer() -> None:
    package = REPO / "kimi_supervisor"
    tree = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    # The version module is written by the install (pyproject's setuptools_scm `version_file`), not the tree's own.
    generated = Path(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools_scm"]["version_file"])
    tree |= {p.stem for p in package.glob("*.py")} - {"__init__", "__main__", generated.stem}
    layered = {name for layer in contract_layers((REPO / "pyproject.toml").read_text()) for name in layer}
    assert tree == layered


def test_the_layout_check_fails_on_a_missing_row_and_on_rows_out_of_order() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    lines = README.splitlines(keepends=True)
    (deployment,) = [i for i, line in enumerate(lines) if line.startswith("| `deployment/` |")]
    without = "".join(lines[:deployment] + lines[deployment + 1 :])
    assert layout_problems(without, pyproject) == ["deployment: layer 2 in the contract, not in the README's Layout"]
    swapped = "".join([*lines[: deployment - 1], lines[deployment], lines[deployment - 1], *lines[deployment + 1 :]])
    assert layout_problems(swapped, pyproject) == [
        "the README's Layout rows are not in the contract's layer order: [2, 1, 3, 4, 4, 5, 5, 6, 6, 6, 7, 7, 8, 9]"
    ]
    renumbered = README.replace("| `cli/` | 1 |", "| `cli/` | 2 |")
    assert layout_problems(renumbered, pyproject) == ["cli: layer 2 in the README's Layout, 1 in the contract"]
    reordered = pyproject.replace(
        '"kimi_supervisor.cli",\n    "kimi_supervisor.deployment",',
        '"kimi_supervisor.deployment",\n    "kimi_supervisor.cli",',
    )
    assert reordered != pyproject
    assert layout_problems(README, reordered) == [
        "deployment: layer 2 in the README's Layout, 1 in the contract",
        "cli: layer 1 in the README's Layout, 2 in the contract",
    ]
