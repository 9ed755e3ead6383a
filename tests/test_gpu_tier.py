"""gpuaccept/gpu_tier/ on CPU: it imports, its report renders the recorded device run byte for byte, its
fake GPU counts what live processes registered, and its pure helpers work. The tier itself needs the
GPUs (docs/gpu-tier.md); `python3 gpuaccept/gpu_tier --fake --out DIR` runs its orchestration on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuaccept.gpu_tier.common import pct, summary
from gpuaccept.gpu_tier.gpus import FakeProbe, Gpus
from gpuaccept.gpu_tier.report import render_md

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "gpuaccept" / "results"


def test_the_report_of_the_recorded_device_run_renders_unchanged() -> None:
    result = json.loads((RESULTS / "gpu_tier_h200x2.json").read_text())
    for row in result["orphans"]["per_gpu"]:
        row["states"] = [tuple(s) for s in row["states"]]  # tuples in the live run, lists through JSON
    recorded = (RESULTS / "gpu_tier_h200x2.md").read_text()
    assert render_md(result) == recorded[recorded.index("# kimi-supervisor GPU tier") :]


def test_percentiles_and_summary() -> None:
    assert pct([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert pct([1.0, 2.0], 0.95) == pytest.approx(1.95)
    s = summary([3.0, 1.0, 2.0])
    assert (s["n"], s["min"], s["median"], s["max"], s["mean"]) == (3, 1.0, 2.0, 3.0, 2.0)
    assert summary([]) == {}


def test_the_fake_gpus_count_memory_of_live_registered_processes(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (tmp_path / "gpu1").mkdir()
        (tmp_path / "gpu1" / str(holder.pid)).write_text("4096")
        (tmp_path / "gpu1" / "4194400").write_text("1")  # a PID that never exists: not counted
        probe = FakeProbe(str(tmp_path), 2)
        gpus = Gpus(probe)
        assert gpus.count == 2 and gpus.used_mib(0) == 0
        assert gpus.used_mib(1) == 4096 + 500 and gpus.pids(1) == [holder.pid]
        assert probe.memory(1).free_mib == 143771 - 4596
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    assert gpus.used_mib(1) == 0 and gpus.pids(1) == []


def test_the_command_line_still_parses() -> None:
    script = REPO / "gpuaccept" / "gpu_tier"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True)
    assert "--fake" in out.stdout and "--only" in out.stdout
    as_module = [sys.executable, "-m", "gpuaccept.gpu_tier", "--help"]
    out = subprocess.run(as_module, capture_output=True, text=True, check=True, cwd=REPO)
    assert "--fake" in out.stdout
