"""Row 8: a chatty child under the real systemd and journald (nspawn): lines/s, watchdog lateness, and the
supervisor's own records lost (target 0).  The scenario is tests/nspawn/flood_scenario.py, the same one
tests/nspawn/test_flood.py asserts on.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.common import Row

SYSTEMD_TESTS = Path(__file__).resolve().parent.parent / "tests" / "nspawn"
LINES = 2_000_000
RATE = 200_000


def run() -> list[Row]:
    sys.path.insert(0, str(SYSTEMD_TESTS))
    from conftest import default_binds_ro
    from flood_scenario import LIFECYCLE, WATCHDOG_S, run_flood
    from nspawn import NspawnMachine, available
    from unit_setup import install

    ok, why = available()
    if not ok:
        return [Row("8. journal flood under systemd", "-", f"skipped: {why}", None)]
    with NspawnMachine(binds_ro=default_binds_ro()) as m:
        install(m)
        r = run_flood(m, LINES, RATE)
    late_ms = max(0.0, r.worst_lateness_s) * 1000
    allowed_ms = 0.1 * WATCHDOG_S * 1000
    lost = len(r.missing) + r.journald_suppressed
    return [
        Row(
            f"8. {LINES:,} child lines at {RATE // 1000}k lines/s after READY, journal, real systemd",
            "-",
            f"child achieved {r.lines_per_s / 1000:.0f}k lines/s; journal got {r.journal_child_lines:,} child lines,"
            f" {r.suppressed:,} counted as suppressed, {r.dropped:,} as dropped",
            None,
        ),
        Row(
            f"8.   watchdog lateness (WatchdogSec={WATCHDOG_S:g}, ping every {WATCHDOG_S / 2:g} s)",
            f"<= {allowed_ms:.0f} ms",
            f"worst {late_ms:.0f} ms over {len(r.watchdog_gaps)} pings",
            late_ms <= allowed_ms,
        ),
        Row(
            "8.   supervisor records lost (lifecycle records missing + journald suppressed)",
            "0",
            f"{lost} (missing: {', '.join(r.missing) or 'none'} of {len(LIFECYCLE)})",
            lost == 0,
        ),
    ]


if __name__ == "__main__":
    for row in run():
        print(f"| {row.name} | {row.target} | {row.measured} | {row.verdict} |")
