"""bench/bench_lifecycle.py's row 11 times a start of the package as installed, with its bytecode: a fresh checkout
run with PYTHONDONTWRITEBYTECODE=1 imports every module from source in every run, which made the H200's row 11
480 ms against 305 ms compiled (bench/results/issue35_gpu.md)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from bench import bench_lifecycle
from testkit.harness import REPO


def uncompiled(package: Path) -> list[Path]:
    return [p for p in package.rglob("*.py") if not Path(importlib.util.cache_from_source(str(p))).is_file()]


def test_row_11_times_the_checkout_with_its_bytecode_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "checkout"
    shutil.copytree(REPO / "kimi_supervisor", tree / "kimi_supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    package = tree / "kimi_supervisor"
    assert uncompiled(package)  # as the device's copy arrives
    seen: list[list[Path]] = []

    def spawn_once(tmp: Path, checkout: Path | None) -> float:
        assert checkout == tree
        seen.append(uncompiled(package))  # what the supervisor's start would have to compile
        return 0.1

    monkeypatch.setattr(bench_lifecycle, "_spawn_once", spawn_once)
    monkeypatch.setattr(bench_lifecycle, "SPAWN_RUNS", 2)
    monkeypatch.setattr(bench_lifecycle, "_bare_start", lambda: 0.05)
    (row,) = bench_lifecycle.spawn_rows((tree,))
    assert seen == [[], []]
    assert "bytecode compiled" in row.name
