"""vLLM's fatal record inside, or right after, a flood of 300,000 stats lines after READY, under the real CLI.

Shared by tests/child/test_output.py (that the fatal record ends the run: the child holds forever after its
flood, so nothing else can) and bench row 4 (how long after the record's write the supervisor's exit record
comes: the target of 1 s is a machine-speed number, so it is measured there, not asserted in the unit tier).
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit.harness import REPO, Run, free_port, write_config

FLOOD_CHILD = REPO / "testkit" / "flood_child.py"
LINES = 300_000
# A hang's bound on the waits for READY and for the exit record, not the measure (bench row 4): beside a second suite
# the flood and the exit took over 120 s.
EXIT_BOUND_S = 600.0


@dataclasses.dataclass(frozen=True)
class FatalFlood:
    rc: int
    exit_event: dict[str, Any]
    fatal_written: float  # CLOCK_MONOTONIC just after the child flushed the fatal record
    exit_seen: float  # CLOCK_MONOTONIC when the supervisor.exit record was read from the supervisor's stderr

    @property
    def latency_s(self) -> float:
        return self.exit_seen - self.fatal_written


def fatal_after_flood(tmp: Path, fatal_after: int, lines: int = LINES) -> FatalFlood:
    """The supervisor around testkit/flood_child.py --ready --hold --fatal-after FATAL_AFTER (0..LINES)."""
    fatal_file = tmp / "fatal-at"
    argv = [sys.executable, str(FLOOD_CHILD), str(lines), str(tmp / "elapsed"), "--port", str(free_port())]
    argv += ["--ready", "--hold", "--fatal-after", str(fatal_after), "--fatal-file", str(fatal_file)]
    shm = tmp / "shm"
    shm.mkdir()
    cfg = write_config(
        tmp / "kimi.toml",
        {
            "child": {"argv": argv},
            "preflight": {"gpus": [], "check_model": False, "check_port": False},
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"poll_interval_s": 0.05},
            # Not under test, and on a loaded machine the flood outlasts their verdicts: the child answers no
            # canary (no /v1/models) and its stats never move.
            "liveness": {"canary_interval_s": 0, "stuck_after_s": 0},
            "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
            "paths": {"runtime_directory": str(tmp / "run"), "state_directory": str(tmp / "state")},
        },
    )
    run = Run(cfg, tmp)
    try:
        run.wait_event("state.ready", timeout=EXIT_BOUND_S)
        exit_event = run.wait_event("supervisor.exit", timeout=EXIT_BOUND_S)
        seen = time.monotonic()
        rc = run.wait()
    finally:
        if run.proc.poll() is None:  # it never acted: a stop request, so that it stops the holding child too
            run.signal()
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.wait(timeout=30)
        run.kill()
    return FatalFlood(rc, exit_event, float(fatal_file.read_text()), seen)
