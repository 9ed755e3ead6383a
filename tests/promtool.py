"""promtool for the tests: `promtool check metrics` on our textfiles, `promtool test rules` on the alerts.

.ci/setup installs it (.ci/install-promtool.sh).  Outside CI a machine without it skips these checks and
says why; in CI (CI=true) a missing promtool fails the test instead, so the checks never silently vanish.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not installed, and CI=true needs it: run `sh .ci/install-promtool.sh`")
        pytest.skip("promtool is not installed (sh .ci/install-promtool.sh installs it; required when CI=true)")
    return found


def check_metrics(data: bytes) -> str:
    """promtool's complaints about one textfile's bytes ('' when it passes).  Lint warnings count: promtool
    exits non-zero on them too (a counter without `_total`, a missing HELP, a non-base unit)."""
    result = subprocess.run([promtool(), "check", "metrics"], input=data, capture_output=True, timeout=60, check=False)
    return "" if result.returncode == 0 else (result.stdout + result.stderr).decode(errors="replace").strip()


def check_textfiles(root: Path) -> dict[str, str]:
    """Every *.prom file under `root` that promtool refuses, with what it says."""
    problems = {}
    for path in sorted(root.rglob("*.prom")):
        if path.is_file() and not path.is_symlink():
            said = check_metrics(path.read_bytes())
            if said:
                problems[str(path)] = said
    return problems
