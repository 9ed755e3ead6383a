"""The console script's address stays `kimi_supervisor.cli:main`: installed scripts and units name it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

from kimi_supervisor.cli import entry

REPO = Path(__file__).resolve().parents[2]


def test_console_script_is_cli_main_and_resolves_to_the_command_line() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kimi-supervisor": "kimi_supervisor.cli:main"}
    module, _, name = scripts["kimi-supervisor"].partition(":")
    assert getattr(importlib.import_module(module), name) is entry.main
