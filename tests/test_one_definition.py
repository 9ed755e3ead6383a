"""One helper, one definition: the words docs/how-it-works.md ("Words") gives one meaning stay one.

Beside tests/test_comment_paths.py (the files comments name) and tests/test_layers.py (the imports), an AST
scan of the same tree fails when a second copy of a helper that was folded into one comes back:
- `parse_json`: untrusted_json.py's, the one parser of JSON from outside; and `json.loads` in the package
  only where the input is ours or the reader pins its own messages (JSON_LOADS_ALLOWED, each with its why);
- a fake clock (a class named `*Clock`, or one with a `monotonic` method, outside the package):
  testkit/fakes/clock.py's FakeClock;
- an escaper (an f-string that writes `\\x`, `\\u` or `\\U` before a hex-formatted value): quoting.py's.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

from tests.test_comment_paths import REPO, ROOTS, SKIPPED_DIRS

PARSE_JSON = {"kimi_supervisor/untrusted_json.py"}
# The real clocks (kimi_supervisor/clock.py; the reactor's, whose sleep runs its turns, and the Wakeups Protocol
# that lower layers see it through) and the fake.
CLOCKS = {
    ("kimi_supervisor/clock.py", "Clock"),
    ("kimi_supervisor/clock.py", "SystemClock"),
    ("kimi_supervisor/lifecycle/reactor.py", "Reactor"),
    ("kimi_supervisor/lifecycle/reactor.py", "ReactorClock"),
    ("kimi_supervisor/wakeups.py", "Wakeups"),
    ("testkit/fakes/clock.py", "FakeClock"),
}
ESCAPERS = {
    "kimi_supervisor/quoting.py",
    # systemd's own grammar for a word of a unit file (C-style escapes, `%%`, `$$`), not a text we show.
    "kimi_supervisor/systemd/unit.py",
    # one_line's escaping as it was, kept as the reference the new one is compared with.
    "tests/liveness/test_http.py",
}
JSON_LOADS_ALLOWED = {
    # the operator's own argv (--speculative-config, --model-loader-extra-config): its errors quote json's.
    "kimi_supervisor/config/weights.py",
    # the model's shard index: its one reader names each failure by the exception's class (pinned by
    # tests/host/test_model_bounds.py) and catches RecursionError itself.
    "kimi_supervisor/host/pagecache.py",
    "kimi_supervisor/untrusted_json.py",
}


def trees() -> Iterator[tuple[str, ast.Module]]:
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if any(part in SKIPPED_DIRS or part.startswith(".") for part in path.relative_to(REPO).parts):
                continue
            rel = path.relative_to(REPO).as_posix()
            yield rel, ast.parse(path.read_text(), rel)


def _hex_escape(node: ast.JoinedStr) -> bool:
    parts = node.values
    for before, after in itertools.pairwise(parts):
        if not (isinstance(before, ast.Constant) and isinstance(before.value, str)):
            continue
        if not isinstance(after, ast.FormattedValue) or after.format_spec is None:
            continue
        spec = "".join(v.value for v in after.format_spec.values if isinstance(v, ast.Constant))
        if before.value[-2:] in ("\\x", "\\u", "\\U") and spec.endswith("x"):
            return True
    return False


def definitions() -> dict[str, set[object]]:
    found: dict[str, set[object]] = {"parse_json": set(), "clock": set(), "escaper": set(), "json.loads": set()}
    for rel, tree in trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "parse_json":
                found["parse_json"].add(rel)
            elif isinstance(node, ast.ClassDef):
                methods = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
                if node.name.endswith("Clock") or "monotonic" in methods:
                    found["clock"].add((rel, node.name))
            elif isinstance(node, ast.JoinedStr) and _hex_escape(node):
                found["escaper"].add(rel)
            elif (
                rel.startswith("kimi_supervisor/")
                and isinstance(node, ast.Attribute)
                and node.attr in ("loads", "load")
                and isinstance(node.value, ast.Name)
                and node.value.id == "json"
            ):
                found["json.loads"].add(rel)
    return found


def test_each_helper_is_defined_once() -> None:
    found = definitions()
    assert found["parse_json"] == PARSE_JSON, "JSON from outside goes through untrusted_json.parse_json"
    assert found["clock"] == CLOCKS, "fake time is testkit/fakes/clock.py's FakeClock"
    assert found["escaper"] == ESCAPERS, "escaping is quoting.escape_controls or quoting.escape_unprintable"
    assert found["json.loads"] <= JSON_LOADS_ALLOWED, "JSON from outside goes through untrusted_json.parse_json"


def test_the_scan_sees_a_second_copy(tmp_path: Path) -> None:
    """Each rule catches the copy it is for (else a scan that sees nothing would pass)."""
    code = """
import json
def parse_json(raw): return json.loads(raw)
class Clock:
    def __call__(self): return 0.0
class Ticker:
    def monotonic(self): return 0.0
def one_line(text): return "".join(c if c.isprintable() else f"\\\\x{ord(c):02x}" for c in text)
"""
    tree = ast.parse(code)
    assert [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_json"]
    assert [n for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) and _hex_escape(n)]
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert [c.name for c in classes if c.name.endswith("Clock")] == ["Clock"]
    assert [c.name for c in classes if any(getattr(m, "name", "") == "monotonic" for m in c.body)] == ["Ticker"]
