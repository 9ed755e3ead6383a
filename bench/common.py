"""Shared by the CPU benchmarks: a result row and small statistics helpers."""

from __future__ import annotations

import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    target: str
    measured: str
    ok: bool | None  # None: information only, no target

    @property
    def verdict(self) -> str:
        return "-" if self.ok is None else ("PASS" if self.ok else "FAIL")


def median(values: list[float]) -> float:
    return statistics.median(values)


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"
