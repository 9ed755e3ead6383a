"""The front's event loop (docs/front.md, The HTTP stack): uvloop's when it is installed, asyncio's without it.

The real CLI runs the front in both cases; a stand-in `uvloop` module first on its PYTHONPATH is "installed"
(its loop is asyncio's own under uvloop's module name), a module that fails to import is "not installed".
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from testkit.harness import REPO, Run, write_config
from testkit.procutil import free_port
from tests.deployment.front.harness import BOUND_S

pytest.importorskip("aiohttp")

_INSTALLED = """
import asyncio

class Loop(asyncio.SelectorEventLoop):
    pass

def new_event_loop():
    return Loop()
"""
_MISSING = 'raise ImportError("not installed")\n'


@pytest.mark.parametrize(
    ("module", "loop"), [(_INSTALLED, "uvloop"), (_MISSING, "asyncio")], ids=["installed", "missing"]
)
def test_the_front_runs_uvloops_loop_when_it_is_installed_else_asyncios(tmp_path: Path, module: str, loop: str) -> None:
    site = tmp_path / "site" / "uvloop"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(module)
    config = write_config(
        tmp_path / "kimi-a.front.toml",
        {
            "deployment": {"name": "kimi-a", "role": "front"},
            "front": {"host": "127.0.0.1", "port": free_port()},
            "paths": {"runtime_directory": str(tmp_path / "run"), "state_directory": str(tmp_path / "state")},
        },
    )
    run = Run(config, tmp_path, env={"PYTHONPATH": f"{site.parent}:{REPO}"})
    try:
        listening = run.wait_event("front.listening", BOUND_S)
        assert listening["loop"] == loop
    finally:
        run.signal(signal.SIGTERM)
        assert run.wait(BOUND_S) == 0
