"""The command line: its grammar (args.py), run, dry run, check-config, install-unit (entry.py), status.py."""

from kimi_supervisor.cli.entry import main

__all__ = ["main"]
