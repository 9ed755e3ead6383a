"""Waiting for GPU memory: shared by the preflight and by the stop path."""

from __future__ import annotations

from collections.abc import Callable

from kimi_supervisor.clock import Clock
from kimi_supervisor.gpu import GpuMemory, GpuProbe, GpuProcess


def busy_gpus(probe: GpuProbe, gpus: tuple[int, ...], threshold_mib: int) -> list[GpuMemory]:
    return [m for m in (probe.memory(i) for i in gpus) if m.used_mib > threshold_mib]


def holders(probe: GpuProbe, gpus: tuple[int, ...]) -> list[GpuProcess]:
    return [p for i in gpus for p in probe.processes(i)]


def wait_until_free(
    probe: GpuProbe,
    gpus: tuple[int, ...],
    threshold_mib: int,
    clock: Clock,
    timeout_s: float,
    poll_s: float,
    on_still_busy: Callable[[list[GpuMemory], float], None],
    report_every_s: float,
) -> list[GpuMemory]:
    """Poll until every GPU's used memory <= threshold; return those still busy at the deadline."""
    start = clock.monotonic()
    last_report = start
    while True:
        busy = busy_gpus(probe, gpus, threshold_mib)
        now = clock.monotonic()
        if not busy or now - start >= timeout_s:
            return busy
        if now - last_report >= report_every_s:
            on_still_busy(busy, now - start)
            last_report = now
        clock.sleep(min(poll_s, max(0.0, start + timeout_s - now)))
