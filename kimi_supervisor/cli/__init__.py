"""The command line: `kimi-supervisor` (entry.py) and its `status` command (status.py)."""

from kimi_supervisor.cli.entry import main

__all__ = ["main"]
