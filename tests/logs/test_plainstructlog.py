"""A start imports no rich: structlog would pull it (and pygments) in for pretty tracebacks it never shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = (
    "import sys; import kimi_supervisor.cli.entry, kimi_supervisor.lifecycle.supervisor, structlog.dev; "
    "print(sorted(m for m in ('rich', 'pygments') if m in sys.modules), structlog.dev.rich)"
)


def test_the_start_path_imports_neither_rich_nor_pygments() -> None:
    pytest.importorskip("rich")  # where it is not installed there is nothing to leave out
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "None"]


def test_rich_imported_before_stays_importable() -> None:
    probe = "import rich, sys; import kimi_supervisor.logs.journal, rich.text; print(sys.modules['rich'] is not None)"
    pytest.importorskip("rich")
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)}
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]
