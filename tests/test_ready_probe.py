"""READY=1 follows the server's first possible 200 by tens of ms, not by a whole readiness poll interval."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.harness import REPO, Run, free_port, write_config

READY_CHILD = REPO / "bench" / "ready_child.py"


def ready_lag(tmp: Path, poll_s: float, listen_after: float) -> float:
    """READY=1 at the notify socket minus the moment the child started listening, in seconds."""
    listening = tmp / "listening"
    argv = [
        sys.executable,
        str(READY_CHILD),
        "--port",
        str(free_port()),
        "--listen-after",
        f"{listen_after:.3f}",
        "--listening-marker",
        str(listening),
        str(tmp / "first-200"),
    ]
    shm = tmp / "shm"
    shm.mkdir()
    cfg = write_config(
        tmp / "kimi.toml",
        {
            "child": {"argv": argv},
            "preflight": {"gpus": [], "check_model": False},
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"poll_interval_s": poll_s, "deadline_s": 30},
            "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
        },
    )
    run = Run(cfg, tmp)
    try:
        run.wait_event("state.ready", timeout=30)
        deadline = time.monotonic() + 5
        while (ready := run.notify.first("READY", "1")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready is not None
        run.signal()
        assert run.wait(timeout=15) == 0
        return ready[0] - float(listening.read_text())
    finally:
        run.kill()


def test_ready_follows_the_first_possible_200_within_50ms_whatever_the_poll_interval(tmp_path: Path) -> None:
    # A 1 s readiness poll would put READY up to 1 s late; after the "started" line /health is probed every 20 ms.
    lags = []
    for i, listen_after in enumerate((0.15, 0.37, 0.61)):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        lags.append(ready_lag(tmp, 1.0, listen_after))
    assert min(lags) > 0  # never before the server could answer
    assert max(lags) <= 0.05, lags
