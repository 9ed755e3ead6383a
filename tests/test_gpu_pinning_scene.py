"""gpuaccept/gpu_pinning.py on CPU (its run is on the device): it imports, and it compares bus ids and ports
the way the supervisor and CUDA write them."""

from __future__ import annotations

import subprocess
import sys

from gpuaccept import gpu_pinning
from kimi_supervisor.config import gpu_pinning as pinning
from tests.conftest import REPO


def test_nvml_and_cuda_spellings_of_one_bus_id_compare_equal() -> None:
    assert gpu_pinning.bus_key("00000000:18:00.0") == gpu_pinning.bus_key("0000:18:00.0") == (0, 0x18, 0, 0)
    assert gpu_pinning.bus_key("00000000:9A:00.0") == gpu_pinning.bus_key("0000:9a:00.0")
    assert gpu_pinning.bus_key("0000:18:00.0") != gpu_pinning.bus_key("0000:19:00.0")


def test_the_scene_expects_the_supervisors_ras_port() -> None:
    assert gpu_pinning.RAS_BASE_PORT == pinning.RAS_BASE_PORT


def test_the_scene_runs_as_one_command() -> None:
    r = subprocess.run([sys.executable, "gpuaccept/gpu_pinning.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--out DIR" in r.stdout
