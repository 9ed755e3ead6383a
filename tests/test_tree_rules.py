"""Tests and benchmarks import each other in neither direction: what both need lives in testkit/ (README, Layout).

A benchmark that imports a test module runs the tests' conftest and fixtures' assumptions inside a measurement; a
test that imports a benchmark makes a benchmark's refactor break the suite.  The rule, read from each file's AST
(beside tests/test_layers.py, which checks the package's own imports):
- no file under tests/ imports `bench` (or `bench.*`), no file under bench/ imports `tests` (or `tests.*`);
- neither puts the other's folder on `sys.path` (`sys.path.insert(0, str(REPO / "tests" / "nspawn"))` followed by
  a bare `from conftest import ...` is the same import by another road).  A path is seen through the module's own
  names: `sys.path.insert(0, str(SYSTEMD_TESTS))` with `SYSTEMD_TESTS = ... / "tests" / "nspawn"` counts.
Running the other tree's script as a process (bench/bench_startup.py runs tests/e2e/make_tiny_model.py) and reading
its data files (tests/fixtures/) are not imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (the folder whose files are checked, the top-level name they must not reach)
RULES = (("tests", "bench"), ("bench", "tests"))
# Known, with the way out.  Row 8 runs the real-systemd flood scenario the nspawn tier asserts on; the way out is
# the nspawn harness (tests/nspawn/nspawn*.py, checkout.py, unit_setup.py, flood_scenario.py) moved into testkit/.
# An entry here is a debt: the test below fails when it is paid and the entry is left behind.
KNOWN = {"bench/bench_journal_flood.py": "tests"}


def _strings(node: ast.AST, names: dict[str, ast.expr], seen: frozenset[str] = frozenset()) -> Iterator[str]:
    """Every string constant in `node`, a name of the module followed to what it was assigned."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value
        elif isinstance(sub, ast.Name) and sub.id in names and sub.id not in seen:
            yield from _strings(names[sub.id], names, seen | {sub.id})


def _is_sys_path_change(node: ast.Call) -> bool:
    f = node.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in ("insert", "append", "extend")
        and ast.unparse(f.value) in ("sys.path", "path")
    )


def reaches(source: str, forbidden: str, filename: str = "<file>") -> list[str]:
    """Where `source` imports the top-level `forbidden`, or puts a path through a folder of that name on sys.path."""
    tree = ast.parse(source, filename)
    names: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names[node.target.id] = node.value
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == forbidden]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == forbidden:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif (
            isinstance(node, ast.Call)
            and _is_sys_path_change(node)
            and any(forbidden in s.split("/") for arg in node.args for s in _strings(arg, names))
        ):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {what}" for line, what in sorted(found)]


def crossings() -> dict[str, list[str]]:
    found = {}
    for folder, forbidden in RULES:
        for path in sorted((REPO / folder).rglob("*.py")):
            where = reaches(path.read_text(encoding="utf-8"), forbidden, str(path))
            if where:
                found[path.relative_to(REPO).as_posix()] = where
    return found


def test_tests_and_benchmarks_import_each_other_in_neither_direction() -> None:
    found = crossings()
    assert {path: where for path, where in found.items() if path not in KNOWN} == {}
    # A debt paid leaves no entry behind.
    assert set(KNOWN) <= set(found), f"no longer crossing, remove from KNOWN: {set(KNOWN) - set(found)}"


def test_the_rule_sees_an_import_and_a_path_on_sys_path() -> None:
    planted = (
        "import sys\n"
        "from pathlib import Path\n"
        "import bench.common\n"
        "from bench import bench_lifecycle\n"
        "from bench.common import Row\n"
        "from testkit import checkout_start\n"
        "HERE = Path(__file__).parent.parent / 'bench'\n"
        "def f():\n"
        "    sys.path.insert(0, str(HERE))\n"
        "    sys.path.append(str(Path('x') / 'testkit'))\n"
        "    argv = ['vllm', 'bench', 'throughput']\n"
    )
    assert reaches(planted, "bench") == [
        "3: import bench.common",
        "4: from bench import ...",
        "5: from bench.common import ...",
        "9: sys.path.insert(0, str(HERE))",
    ]
    assert reaches(planted, "tests") == []
    assert reaches("import testsuite\nfrom tests_extra import x\n", "tests") == []
    assert reaches("from tests.cli.test_entry import cli\n", "tests") == ["1: from tests.cli.test_entry import ..."]
