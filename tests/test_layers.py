"""The package's import graph, without import-linter: no cycles, no `TYPE_CHECKING` imports, no package
`__init__` importing its own modules (pyproject `[tool.importlinter]` holds the layers; .ci/run checks them).

Every import counts, a function's own included: a cycle hidden in a function (the old gpu <-> nvml_health) is
still a cycle. A package's `__init__` runs before any of its modules, so one that imports them closes a cycle
with each of them that imports a sibling (the old preflight <-> preflight.run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kimi_supervisor"
# The console script's address is `kimi_supervisor.cli:main` (pyproject): cli/__init__ re-exports it.
INIT_IMPORTS_ALLOWED = {"kimi_supervisor.cli": {"kimi_supervisor.cli.entry"}}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package `path` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def type_checking_imports(root: Path = PACKAGE) -> list[str]:
    found = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                found.append(f"{name}:{node.lineno}")
    return found


def init_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    edges = graph(root)
    found = {}
    for name, path in modules(root).items():
        own = {m for m in edges[name] if m.startswith(name + ".")} if path.name == "__init__.py" else set()
        own -= INIT_IMPORTS_ALLOWED.get(name, set())
        if own:
            found[name] = own
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_type_checking_imports_in_the_package() -> None:
    assert type_checking_imports() == []


def test_no_package_init_imports_its_own_modules() -> None:
    assert init_imports() == {}


def test_the_checks_see_a_cycle_a_hidden_one_and_a_type_checking_import(tmp_path: Path) -> None:
    pkg = tmp_path / "kimi_supervisor"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from kimi_supervisor.sub import b\n")
    (pkg / "a.py").write_text("from kimi_supervisor.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from kimi_supervisor import a\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from kimi_supervisor import a\n")
    assert cycles(graph(pkg)) == [["kimi_supervisor.a", "kimi_supervisor.sub", "kimi_supervisor.sub.b"]]
    assert type_checking_imports(pkg) == ["kimi_supervisor.c:2"]
    assert init_imports(pkg) == {"kimi_supervisor.sub": {"kimi_supervisor.sub.b"}}


def test_the_role_rooms_are_a_layer_between_cli_and_lifecycle() -> None:
    # kimi_supervisor/deployment/: one room per role, above the lifecycle it drives and below cli that picks it.
    from kimi_supervisor.config.load import tomllib  # tomli before Python 3.11

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    (contract,) = pyproject["tool"]["importlinter"]["contracts"]
    layers = contract["layers"]
    assert layers[:3] == ["kimi_supervisor.cli", "kimi_supervisor.deployment", "kimi_supervisor.lifecycle"]
