"""A real process that outlives SIGKILL: the real CLI supervisor, the fake vLLM, and one of its workers frozen by a
cgroup-v1 freezer the test mounts (testkit/freezer.py).  A frozen task is in D state and its SIGKILL stays pending,
as an EngineCore stuck in nvidia_uvm does (vLLM #25127): what the supervisor reads of it comes from the real /proc.

The stop ends with exit 22 after the grace and the SIGKILL wait, not after the GPU-release wait; a later start's
preflight finds the same process as a stale victim and exits 22 naming it, not after its deadline.  Then the test
thaws it and the pending SIGKILL ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kimi_supervisor.config import layout
from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.files.atomic import write_atomic
from testkit.freezer import Freezer, FreezerUnavailable
from testkit.harness import HANG_S, REPO, Run, fake_config, fake_tree_of
from tests.cli.test_refused_start import runs
from tests.conftest import wait_for

GRACE_S = 1.0
REAP_GRACE_S = 0.5
# Far beyond grace + SIGKILL wait: a run that waited for the GPUs (or the preflight's deadline) would log that wait
# (stop.gpu_wait, preflight.gpu_busy), which the test looks for; the waits below only stop a hung test.
GPU_RELEASE_TIMEOUT_S = 120
PREFLIGHT_DEADLINE_S = 120


@pytest.fixture
def freezer(tmp_path: Path) -> Iterator[Freezer]:
    try:
        f = Freezer(tmp_path)
    except FreezerUnavailable as exc:
        why = f"a process made unkillable needs root and the cgroup-v1 freezer: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI=true needs it")
        pytest.skip(why)
    try:
        yield f
    finally:
        f.close()


def gpus_with(path: Path, occupants: dict[int, int]) -> None:
    """Two fake GPUs; `occupants` on GPU 1 (testkit/fakes/gpu_cli.py re-reads the file at every probe)."""
    gpus = [
        {"total_mib": 97887, "occupants": {}},
        {"total_mib": 97887, "occupants": {str(p): m for p, m in occupants.items()}},
    ]
    write_atomic(path, json.dumps(gpus).encode())


def start(config: Path, gpus: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testkit.fakes.gpu_cli", str(gpus), "--config", str(config), "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=PREFLIGHT_DEADLINE_S + HANG_S,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )


def test_a_frozen_worker_ends_the_stop_with_22_and_a_later_preflight_names_it_at_once(
    tmp_path: Path, freezer: Freezer
) -> None:
    gpus = tmp_path / "gpus.json"
    gpus_with(gpus, {})
    config = fake_config(
        tmp_path,
        tp=2,
        deployment={"name": "kimi"},
        preflight={"gpus": [0, 1], "deadline_s": PREFLIGHT_DEADLINE_S},
        preflight__reap={"grace_s": REAP_GRACE_S},
        shutdown={"grace_s": GRACE_S, "gpu_release_timeout_s": GPU_RELEASE_TIMEOUT_S},
    )
    run = Run(config, tmp_path, entry=["-m", "testkit.fakes.gpu_cli", str(gpus)])
    try:
        run.wait_event("state.ready", timeout=60)

        def worker() -> psutil.Process | None:
            return next((p for p in fake_tree_of(str(tmp_path)) if p.name().startswith("VLLM::Worker_TP1")), None)

        found = wait_for(worker, timeout=30)
        assert isinstance(found, psutil.Process)
        pid, born = found.pid, found.create_time()
        gpus_with(gpus, {pid: 70000})  # NVML would list it on GPU 1
        freezer.freeze([pid])
        status = Path(f"/proc/{pid}/status").read_text()
        assert "State:\tD (disk sleep)" in status
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()

        t0 = run.signal(signal.SIGTERM)
        rc = run.wait(GPU_RELEASE_TIMEOUT_S + HANG_S)
        took = time.monotonic() - t0
    finally:
        run.kill()
    assert rc == ExitCode.GPU_NEEDS_RESET, run.why()
    assert took >= GRACE_S + SIGKILL_WAIT_S  # the grace and the SIGKILL wait were given
    # No GPU-release wait (its records: stop.gpu_wait while it waits, then released or still busy): was `took <
    # 36 s`, a speed.
    assert not {"stop.gpu_wait", "stop.gpu_still_busy", "stop.gpu_released"} & set(run.names()), run.names()
    stuck = run.event("stop.unkillable")
    assert stuck is not None, run.names()
    assert (stuck["pid"], stuck["state"], stuck["wchan"]) == (pid, "D (disk sleep)", wchan or None)
    failed = run.event("state.failed")
    assert failed is not None, run.names()
    said = json.dumps(failed)
    assert "GPU 1 needs a reset or the host a reboot" in said
    assert f"PID {pid} (VLLM::Worker_TP" in said and "state D (disk sleep)" in said
    if wchan and wchan != "0":
        assert f"waiting in {wchan}" in said
    state = json.loads(layout.of(load_config(config)).state_file.read_text())
    assert state["phase"] == "failed" and f"PID {pid}" in json.dumps(state)
    assert runs(config)[-1]["exit_code"] == ExitCode.GPU_NEEDS_RESET
    assert psutil.Process(pid).create_time() == born  # still there, frozen, its SIGKILL pending

    # A later start: the frozen worker is a stale process on GPU 1; the reap cannot end it.
    later = start(config, gpus)
    assert later.returncode == ExitCode.GPU_NEEDS_RESET, later.stderr[-3000:]
    # Named at once, not its deadline waited out: the stuck worker is named by the reap, before any memory wait
    # (whose records are preflight.gpu_busy).  Was `took < 120 s`, a speed.
    assert '"preflight.unkillable"' in later.stderr and '"preflight.gpu_busy"' not in later.stderr, later.stderr[-3000:]
    assert "preflight: GPU 1 needs a reset or the host a reboot" in later.stderr
    assert f"PID {pid} (VLLM::Worker_TP" in later.stderr and "state D (disk sleep)" in later.stderr
    assert runs(config)[-1]["exit_code"] == ExitCode.GPU_NEEDS_RESET

    # Thawed, the pending SIGKILL lands: nothing of the tree is left.
    freezer.thaw()

    def gone() -> bool:
        try:
            p = psutil.Process(pid)
            return p.create_time() != born or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, timeout=30)
    assert fake_tree_of(str(tmp_path)) == []
