"""A supervisor checkout's start and crash exit, timed (bench/bench_lifecycle.py rows 10 and 11): which checkout
runs, its bytecode compiled first, the machine's own pace beside it.  Here, not in bench/, so that a test can hold
row 11 to its rules (tests/test_bench_spawn.py) without importing a benchmark: tests and benchmarks share testkit/
and import each other in neither direction (tests/test_tree_rules.py)."""

from __future__ import annotations

import compileall
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from testkit.harness import REPO, Run, fake_config


def checkout_entry(tree: Path | None) -> list[str] | None:
    """The supervisor of checkout `tree` (None: this one); `-m` would put the working directory first."""
    if tree is None:
        return None
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); from kimi_supervisor.cli import main; sys.exit(main())"
    return ["-c", code]


def bare_start(runs: int = 5) -> float:
    """The median seconds of `python3 -c pass` here: the machine's pace beside the crash and spawn rows."""
    took = []
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        took.append(time.monotonic() - t0)
    return statistics.median(took)


def spawn_once(tmp: Path, tree: Path | None) -> float:
    """Seconds from the supervisor's exec to the fake vLLM's: both create times, on one clock (boot ticks)."""
    run = Run(fake_config(tmp), tmp, entry=checkout_entry(tree), env={"PYTHONDONTWRITEBYTECODE": "1"})
    try:
        run.wait_event("state.starting", timeout=60)
        took = psutil.Process(run.child_pid).create_time() - psutil.Process(run.proc.pid).create_time()
        run.signal()
        run.wait(timeout=30)
        return took
    finally:
        run.kill()


def compile_tree(tree: Path | None) -> Path:
    """The checkout's kimi_supervisor/ compiled to bytecode, as an installed package has it (pip compiles on
    install); its directory.  The runs set PYTHONDONTWRITEBYTECODE=1, so a fresh checkout (the device's copy)
    would otherwise import from source in every run: on the H200, 480 ms against 305 ms compiled
    (bench/results/issue35_gpu.md)."""
    package = (tree or REPO) / "kimi_supervisor"
    if not compileall.compile_dir(str(package), quiet=1):
        raise RuntimeError(f"{package}: compileall failed")
    return package


def spawn_times(
    trees: tuple[Path | None, ...], runs: int, compile_first: bool = True
) -> dict[Path | None, list[float]]:
    """Each tree's start -> spawn seconds over `runs` runs, interleaved (a busy moment of the machine hits every
    tree alike).  `compile_first=False`: the trees as they are (gpuaccept/gpu_incident.py compares one without
    bytecode)."""
    for tree in trees if compile_first else ():
        compile_tree(tree)
    took: dict[Path | None, list[float]] = {t: [] for t in trees}
    for _ in range(runs):
        for tree in trees:
            with tempfile.TemporaryDirectory(prefix="kimi-bench-spawn-") as tmp:
                took[tree].append(spawn_once(Path(tmp), tree))
    return took
