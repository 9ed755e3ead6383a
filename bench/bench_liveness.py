#!/usr/bin/env python3
"""Rows 6 and 7: READY=1 lag after the server can first answer 200; time to detect a wedged engine.

    python3 bench/bench_liveness.py      (also a part of bench/run.py; alone it writes bench/results/liveness.md)

6. The real CLI around testkit/ready_child.py, which starts listening a random
   0-0.3 s after printing vLLM's "started" line: READY=1 at the notify socket
   minus the moment it started listening (the first moment a probe could get a
   200), 20 starts, the default readiness poll interval (0.25 s).
7. The real CLI around the fake vLLM with --wedged-after: /health stays 200,
   completions hang, /metrics freezes with requests running.  Time from the
   wedge to the supervisor's exit 17, by the canary and by token progress.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import Row, median, ready_lags, spread, table  # noqa: E402
from testkit.harness import Run, fake_config  # noqa: E402

READY_RUNS = 20
WEDGE_RUNS = 3
WEDGED_AFTER_S = 1.0


def ready_rows() -> list[Row]:
    rng = random.Random(15)
    lags = ready_lags(READY_RUNS, 0.25, rng, lambda t: t.listening)
    return [
        Row(
            f"6. READY=1 after /health can first answer 200, poll 0.25 s ({READY_RUNS} starts)",
            "<= 50 ms, never before",
            spread(lags),
            min(lags) > 0 and max(lags) <= 0.050,
        )
    ]


def _detect_once(tmp: Path, liveness: dict[str, object]) -> tuple[float, int, str]:
    """Seconds from the wedge to the supervisor's exit, the exit code, the verdict."""
    run = Run(fake_config(tmp, ["--wedged-after", str(WEDGED_AFTER_S)], liveness=liveness), tmp)
    try:
        run.wait_event("state.ready", timeout=60)
        ready = run.notify.wait_first("READY", "1")
        # The fake counts from its own ready, a few ms before READY=1: this slightly overstates detection.
        wedged_at = ready[0] + WEDGED_AFTER_S
        rc = run.proc.wait(timeout=120)
        took = time.monotonic() - wedged_at
        run.wait(timeout=30)
        exit_event = run.event("supervisor.exit") or {}
        return took, rc, str(exit_event.get("error", ""))
    finally:
        run.kill()


def detection_rows() -> list[Row]:
    cases = (
        (
            "canary every 1 s, timeout 1 s, 2 failures",
            {"canary_interval_s": 1, "canary_timeout_s": 1, "failures_tolerated": 2, "stuck_after_s": 0},
            1 + 1 + 1 + 1 + 1,  # interval + timeout + retry pause + timeout, + 1 s slack
        ),
        (
            "token progress, stuck_after 2 s, metrics every 0.5 s",
            {"canary_interval_s": 0, "stuck_after_s": 2, "metrics_interval_s": 0.5},
            2 + 0.5 + 1,
        ),
    )
    rows = []
    for label, liveness, bound in cases:
        results = []
        for _ in range(WEDGE_RUNS):
            with tempfile.TemporaryDirectory(prefix="kimi-bench-wedge-") as tmp:
                results.append(_detect_once(Path(tmp), liveness))
        took = [r[0] for r in results]
        rcs = sorted({r[1] for r in results})
        rows.append(
            Row(
                f"7. wedged engine detected, {label} ({WEDGE_RUNS} runs)",
                f"exit 17 within {bound:g} s",
                f"median {median(took):.2f} s, max {max(took):.2f} s; exit {rcs}",
                rcs == [17] and max(took) <= bound,
            )
        )
    return rows


def main() -> int:
    rows = ready_rows() + detection_rows()
    text = table(rows)
    print(text)
    out = REPO / "bench" / "results" / "liveness.md"
    out.write_text(
        "# kimi-supervisor liveness benchmarks\n\n"
        f"- command: `python3 bench/bench_liveness.py` (from the repository root)\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n\n" + text + "\n"
    )
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
