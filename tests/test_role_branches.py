"""Role branches outside the role rooms: a role is one object (kimi_supervisor/deployment/), so the rest of the
package asks it and seldom names a role.  Counts, per module, every comparison that names `Role.X` or a `.role`,
and every test of a role flag (`in_group`, `maps_held_weights`, `serves_api`); the count outside
kimi_supervisor/deployment/ and the roles.py leaf must stay under a ceiling, and each branch left there says why
in a comment on its line or the line above.

What the layers below deployment/ need of a role without its object (the config's parse-time rules, whether its
child opens a port, which side of the weights pair it is) is one value of its spec, config/role_spec.py: a table
with a row per role and no branch of its own (checked below), looked up by role and applied as data.

History: 33 on dffe087; 17 once the roles became deployment/'s objects (config/load.py held 9, the parse-time
checks of each role's tables); 4 once those checks, the preflight's port and the view's weights document became
the role spec's values.

Run `python3 tests/test_role_branches.py` for the table (module, count); `--all` counts the role rooms too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kimi_supervisor"
FLAGS = {"in_group", "maps_held_weights", "serves_api"}
# The role rooms and the leaf that defines the roles: branching on a role is their job.
ROLE_ROOMS = ("deployment/", "roles.py")
CEILING = 4  # see the history above
SPEC = PACKAGE / "config" / "role_spec.py"


def _names_role(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "Role":
            return True
        return node.attr == "role"
    if isinstance(node, ast.Tuple):
        return any(_names_role(e) for e in node.elts)
    return False


def _branches_on_role(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        return any(_names_role(e) for e in [node.left, *node.comparators])
    return isinstance(node, ast.Attribute) and node.attr in FLAGS and isinstance(node.ctx, ast.Load)


def branches(path: Path) -> list[int]:
    """The lines of `path` that branch on a role."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(node.lineno for node in ast.walk(tree) if _branches_on_role(node))  # type: ignore[attr-defined]


def counts(include_rooms: bool = False) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not include_rooms and rel.startswith(ROLE_ROOMS):
            continue
        if hits := branches(path):
            found[rel] = hits
    return found


def test_role_branches_outside_the_role_rooms_stay_few() -> None:
    found = counts()
    total = sum(len(v) for v in found.values())
    assert total <= CEILING, f"{total} role branches outside deployment/ (ceiling {CEILING}): {found}"


def test_each_role_branch_left_says_why() -> None:
    for rel, hits in counts().items():
        text = (PACKAGE / rel).read_text().splitlines()
        for line in hits:
            said = "#" in text[line - 1] or text[line - 2].lstrip().startswith("#")
            assert said, f"kimi_supervisor/{rel}:{line}: a role branch outside deployment/ says why in a comment"


def test_the_role_spec_is_data_and_branches_on_nothing() -> None:
    """config/role_spec.py is where each role's rules are written; a branch there would be a role branch that
    the count above does not see."""
    tree = ast.parse(SPEC.read_text(), str(SPEC))
    found = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.Compare, ast.BoolOp, ast.Match))]
    assert not found, f"kimi_supervisor/config/role_spec.py branches at lines {found}: keep it a table of values"


if __name__ == "__main__":
    table = counts(include_rooms="--all" in sys.argv)
    for rel, hits in table.items():
        print(f"{len(hits):3d}  kimi_supervisor/{rel}  (lines {', '.join(map(str, hits))})")
    print(f"{sum(len(v) for v in table.values()):3d}  in {len(table)} modules")
