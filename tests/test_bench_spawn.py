"""bench/bench_lifecycle.py's row 11 times a start of the package as installed, with its bytecode: a fresh checkout
run with PYTHONDONTWRITEBYTECODE=1 imports every module from source in every run, which made the H200's row 11
480 ms against 305 ms compiled (bench/results/issue35_gpu.md).  The row's runs are testkit/checkout_start.py's
(a test imports no benchmark: tests/test_tree_rules.py)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from testkit import checkout_start
from testkit.harness import REPO


def uncompiled(package: Path) -> list[Path]:
    return [p for p in package.rglob("*.py") if not Path(importlib.util.cache_from_source(str(p))).is_file()]


def copied_package(tmp_path: Path) -> tuple[Path, Path]:
    tree = tmp_path / "checkout"
    shutil.copytree(REPO / "kimi_supervisor", tree / "kimi_supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    package = tree / "kimi_supervisor"
    assert uncompiled(package)  # as the device's copy arrives
    return tree, package


def test_row_11_times_the_checkout_with_its_bytecode_compiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, package = copied_package(tmp_path)
    seen: list[list[Path]] = []

    def spawn_once(tmp: Path, checkout: Path | None) -> float:
        assert checkout == tree
        seen.append(uncompiled(package))  # what the supervisor's start would have to compile
        return 0.1

    monkeypatch.setattr(checkout_start, "spawn_once", spawn_once)
    assert checkout_start.spawn_times((tree,), runs=2) == {tree: [0.1, 0.1]}
    assert seen == [[], []]


def test_without_compile_first_the_tree_is_timed_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gpuaccept/gpu_incident.py compares a copy without bytecode against a compiled one.
    tree, package = copied_package(tmp_path)
    left = len(uncompiled(package))
    seen: list[int] = []

    def spawn_once(tmp: Path, checkout: Path | None) -> float:
        seen.append(len(uncompiled(package)))
        return 0.1

    monkeypatch.setattr(checkout_start, "spawn_once", spawn_once)
    checkout_start.spawn_times((tree,), runs=1, compile_first=False)
    assert seen == [left]


def test_another_checkout_runs_its_own_package_and_this_one_runs_as_the_harness_starts_it(tmp_path: Path) -> None:
    assert checkout_start.checkout_entry(None) is None
    entry = checkout_start.checkout_entry(tmp_path)
    assert entry is not None and entry[0] == "-c" and repr(str(tmp_path)) in entry[1]
