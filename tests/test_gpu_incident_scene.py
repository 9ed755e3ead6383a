"""gpuaccept/gpu_incident.py on CPU (its run is on the device: bench/results/issue35_gpu.md): it runs as one command,
and its reading of `-X importtime` finds the start path's modules with their cumulative times."""

from __future__ import annotations

import os
import subprocess
import sys

from gpuaccept import gpu_incident
from tests.conftest import REPO


def test_the_scene_runs_as_one_command() -> None:
    argv = [sys.executable, "gpuaccept/gpu_incident.py", "--help"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--fake" in r.stdout and "--out" in r.stdout


def test_importtime_names_the_start_path_and_its_total() -> None:
    total, top = gpu_incident.importtime_top({**os.environ, "PYTHONPATH": str(REPO)})
    names = [r["name"] for r in top]
    assert names[0] == "kimi_supervisor.cli" and "kimi_supervisor.cli.entry" in names
    assert total == top[0]["cum_ms"] > 0
    assert [r["cum_ms"] for r in top] == sorted((r["cum_ms"] for r in top), reverse=True)
