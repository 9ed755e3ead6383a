"""A chatty child under the real systemd and journald: shared by the systemd test and bench row 8.

The shipped unit (LogRateLimit* included) runs this checkout's supervisor (a wrapper in the container
runs `python -m kimi_supervisor` from the bound checkout) around testkit/flood_child.py, which answers
/health, then prints LINES lines at RATE lines/s after READY and keeps serving.  Measured from systemd
itself: WatchdogTimestampMonotonic (updated on every WATCHDOG=1), the unit's journal (every lifecycle
record present?), and journald's own "Suppressed N messages" notices.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time

from nspawn import NspawnMachine
from unit_setup import REPO, UNIT, config_toml, deploy, now

FLOOD_CHILD = REPO / "testkit" / "flood_child.py"
FLOOD_MARK = "[loggers.py:123] Engine 000: "  # in each of the flood child's vLLM stats lines
WATCHDOG_S = 2.0
LIFECYCLE = (
    "supervisor.start",
    "preflight.passed",
    "state.starting",
    "state.ready",
    "signal.received",
    "state.stopping",
    "stop.sigterm",
    "stop.tree_gone",
    "state.stopped",
)


@dataclasses.dataclass
class FloodResult:
    lines: int
    child_seconds: float  # as the child measured it (from its last line), 0 if unknown
    journal_child_lines: int
    suppressed: int  # reported in child.suppressed records
    dropped: int  # reported in child.dropped records (journald's socket queue was full)
    missing: list[str]  # lifecycle records that did not reach the journal
    journald_suppressed: int  # messages journald itself dropped for the unit
    watchdog_gaps: list[float]  # between the pings the watcher saw: a ping it missed doubles one
    silences: list[float]  # per poll: how long before the poll's start the last ping came (seen, so proven)
    restarts: int

    @property
    def lines_per_s(self) -> float:
        return self.lines / self.child_seconds if self.child_seconds else 0.0

    @property
    def worst_lateness_s(self) -> float:
        """How much later than WatchdogSec/2 a ping came, at least: the longest silence a poll saw.

        Not the largest gap between the pings seen: the watcher runs `systemctl show` in the container, which a busy
        host can delay past a ping, and a missed ping doubles a gap that was on time (CI saw 2.003 s so)."""
        return max(self.silences, default=0.0) - WATCHDOG_S / 2


def _config(lines: int, rate: int) -> str:
    argv = [sys.executable, str(FLOOD_CHILD), str(lines), "/dev/null", "--port", "8000", "--ready"]
    argv += ["--rate", str(rate), "--hold"]
    # flood_child is no vLLM: it answers /health alone, so the canary (GET /v1/models when argv names no model,
    # then a completion) could only fail, and its streak would restart the unit mid-scenario (exit 17).
    liveness = "[liveness]\ncanary_interval_s = 0"
    return config_toml(argv, health="interval_s = 0.3\ntimeout_s = 0.5", extra=liveness)


def run_flood(m: NspawnMachine, lines: int = 2_000_000, rate: int = 200_000) -> FloodResult:
    deploy(m, _config(lines, rate), f"[Service]\nRestartSec=1\nWatchdogSec={WATCHDOG_S:g}\nTimeoutStopSec=15\n")
    since = now(m)
    time.sleep(1.0)  # "since" has a resolution of one second
    stamps: list[int] = []
    silences: list[float] = []
    done = threading.Event()

    def watch() -> None:
        # The container shares the host's CLOCK_MONOTONIC (no time namespace), which systemd's stamp is in.  A poll
        # that starts at `asked` and reads ping `value` proves no ping came in (value, asked): a lower bound on the
        # silence, whatever the poll's own delay.
        while not done.is_set():
            asked = time.monotonic()
            value = m.unit_property(UNIT, "WatchdogTimestampMonotonic")
            if value.isdigit() and int(value):
                silences.append(asked - int(value) / 1e6)
                if not stamps or int(value) != stamps[-1]:
                    stamps.append(int(value))
            time.sleep(0.1)

    m.systemctl("start", UNIT, timeout=60)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        deadline = time.monotonic() + lines / rate * 4 + 30
        while time.monotonic() < deadline and "flood done" not in m.journal(UNIT, "--since", since, "-p", "warning"):
            time.sleep(1.0)
        time.sleep(2.0)
    finally:
        done.set()
        watcher.join()
    restarts = int(m.unit_property(UNIT, "NRestarts") or 0)
    m.systemctl("stop", UNIT, timeout=30)
    records = m.journal_json(UNIT, "--since", since)
    events = {r.get("KIMI_EVENT") for r in records if r.get("KIMI_SOURCE") == "supervisor"}
    child = [r for r in records if r.get("KIMI_SOURCE") == "child" and FLOOD_MARK in r.get("MESSAGE", "")]
    suppressed = sum(int(r.get("KIMI_LINES", 0)) for r in records if r.get("KIMI_EVENT") == "child.suppressed")
    dropped = sum(int(r.get("KIMI_LINES", 0)) for r in records if r.get("KIMI_EVENT") == "child.dropped")
    done_line = next((r["MESSAGE"] for r in records if "flood done" in r.get("MESSAGE", "")), "")
    seconds = float(done_line.split(" lines in ")[1].split(" s")[0]) if done_line else 0.0
    journald = m.run(["journalctl", "--no-pager", "-o", "cat", "--since", since, "_COMM=systemd-journal"]).stdout
    journald_suppressed = sum(
        int(line.split("Suppressed ")[1].split()[0])
        for line in journald.splitlines()
        if UNIT in line and "Suppressed" in line
    )
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(stamps)]
    return FloodResult(
        lines=lines,
        child_seconds=seconds,
        journal_child_lines=len(child),
        suppressed=suppressed,
        dropped=dropped,
        missing=[e for e in LIFECYCLE if e not in events],
        journald_suppressed=journald_suppressed,
        watchdog_gaps=gaps,
        silences=silences,
        restarts=restarts,
    )
