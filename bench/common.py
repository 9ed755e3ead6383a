"""Shared by the CPU benchmarks: a result row and its table, small statistics helpers, READY=1 lag over many starts."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from testkit.harness import ReadyTimes, ready_child_times


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    target: str
    measured: str
    ok: bool | None  # None: information only, no target

    @property
    def verdict(self) -> str:
        return "-" if self.ok is None else ("PASS" if self.ok else "FAIL")


def table(rows: list[Row]) -> str:
    head = ("benchmark", "target", "measured", "verdict")
    cells = [head, *((r.name, r.target, r.measured, r.verdict) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["| " + " | ".join(c[i].ljust(widths[i]) for i in range(4)) + " |" for c in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def median(values: list[float]) -> float:
    return statistics.median(values)


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"


def spread(values: list[float]) -> str:
    return f"median {ms(median(values))}, max {ms(max(values))}, min {ms(min(values))}"


def ready_lags(runs: int, poll_s: float, rng: random.Random, since: Callable[[ReadyTimes], float]) -> list[float]:
    """Seconds from SINCE(times) to READY=1 over RUNS real starts around testkit/ready_child.py, each listening
    a random 0-0.3 s after its start line."""
    lags = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="kimi-bench-ready-") as tmp:
            times = ready_child_times(Path(tmp), poll_s, rng.uniform(0.0, 0.3))
            lags.append(times.ready - since(times))
    return lags
