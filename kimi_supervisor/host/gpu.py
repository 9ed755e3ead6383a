"""The GPU boundary: a small Protocol and its types, and waiting for memory (NVML: nvml.py).

Memory is counted the way nvidia-smi shows it: NVML's v2 memory info, whose
`used` leaves out the driver-reserved part (an idle H200 reads v1 used=615 MiB,
v2 used=0 with reserved=615).  Where v2 is not supported we fall back to v1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

from kimi_supervisor.clock import Clock
from kimi_supervisor.config.gpu_pinning import pin_every_gpu
from kimi_supervisor.config.model import ChildConfig
from kimi_supervisor.exitcodes import ExitCode

MIB = 1024 * 1024


class GpuUnavailable(Exception):
    """NVML cannot be used (no driver, no library, no permission)."""

    # Not a SupervisorError (most callers turn it into a check result), but a run it ends exits 10.
    exit_code = ExitCode.PREFLIGHT_FAILED
    reason = "NVML lost a GPU or its driver"


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    index: int
    total_mib: int
    used_mib: int
    free_mib: int


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """A process NVML says holds a context on a GPU (host PID namespace)."""

    pid: int
    gpu: int
    used_mib: int | None  # None: the driver would not say (containers, MIG)


@dataclasses.dataclass(frozen=True)
class GpuHealth:
    """NVML's health counters for one GPU; None where the device does not support a query."""

    index: int
    retired_pages: int | None = None  # pages retired for single- plus double-bit ECC (before Ampere)
    retired_pages_pending: bool | None = None  # a retirement waits for a reset
    remapped_rows_correctable: int | None = None  # Ampere and later: row remapping replaces page retirement
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None  # a remap waits for a reset
    remapped_rows_failed: bool | None = None  # the remapper ran out of spare rows
    ecc_uncorrected_volatile: int | None = None  # since the driver loaded
    pcie_width: int | None = None
    pcie_max_width: int | None = None
    pcie_gen: int | None = None
    pcie_max_gen: int | None = None
    persistence_mode: bool | None = None
    clock_event_reasons: int | None = None  # NVML's clocks-event (throttle) reason bit mask
    # Queries that failed for another reason than "not supported": field name -> NVML's words.
    errors: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GpuActivity:
    """What a GPU is doing now (an incident's view of it, opsview/forensics.py); None where NVML would not say."""

    index: int
    gpu_util_pct: int | None = None  # of the last sample period, a kernel was running
    memory_util_pct: int | None = None  # of the last sample period, device memory was read or written
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    errors: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """A critical event NVML delivered for one of our GPUs."""

    gpu: int
    kind: str  # "xid", "double_bit_ecc" or "gpu_lost"
    xid: int | None = None


class GpuEventWatch(Protocol):
    # Per watched GPU, the event kinds NVML accepted ("xid", "double_bit_ecc"); () when none is supported.
    registered: Mapping[int, tuple[str, ...]]

    def wait(self, timeout_s: float) -> GpuEvent | None:
        """The next event, or None after `timeout_s` without one."""
        ...

    def close(self) -> None: ...


class GpuProbe(Protocol):
    def device_count(self) -> int: ...

    def memory(self, index: int) -> GpuMemory: ...

    def processes(self, index: int) -> list[GpuProcess]: ...

    def health(self, index: int) -> GpuHealth: ...

    def activity(self, index: int) -> GpuActivity: ...

    def watch_events(self, indices: tuple[int, ...]) -> GpuEventWatch: ...

    def close(self) -> None: ...


def configured_gpus(probe: GpuProbe, gpus: tuple[int, ...] | None) -> tuple[int, ...]:
    """`preflight.gpus`, or every GPU NVML sees when that is "all" (None); () when NVML cannot say."""
    if gpus is not None:
        return gpus
    try:
        return tuple(range(probe.device_count()))
    except GpuUnavailable:
        return ()


def pin_configured_gpus(child: ChildConfig, gpus: tuple[int, ...] | None, probe: GpuProbe) -> ChildConfig:
    """`child` pinned to every GPU NVML sees now when preflight.gpus is "all"; a list was pinned by the config."""
    if gpus is not None:
        return child
    return dataclasses.replace(child, env=pin_every_gpu(child.env, len(configured_gpus(probe, None))))


# Waiting for memory: shared by the preflight and by the supervisor's stop path.


def busy_gpus(
    probe: GpuProbe, gpus: tuple[int, ...], threshold_mib: int, own: Mapping[int, int] | None = None
) -> list[GpuMemory]:
    """GPUs using more than the threshold; `own`: MiB per GPU that is the deployment's own (its weight
    holder's, which the engine maps instead of allocating), not counted."""
    own = own or {}
    return [m for m in (probe.memory(i) for i in gpus) if m.used_mib - own.get(m.index, 0) > threshold_mib]


def gpu_processes(probe: GpuProbe, gpus: tuple[int, ...]) -> list[GpuProcess]:
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
    own: Mapping[int, int] | None = None,
) -> list[GpuMemory]:
    """Poll until every GPU's used memory <= threshold; return those still busy at the deadline."""
    start = clock.monotonic()
    last_report = start
    while True:
        busy = busy_gpus(probe, gpus, threshold_mib, own)
        now = clock.monotonic()
        if not busy or now - start >= timeout_s:
            return busy
        if now - last_report >= report_every_s:
            on_still_busy(busy, now - start)
            last_report = now
        clock.sleep(min(poll_s, max(0.0, start + timeout_s - now)))


def nvml_text(exc: Exception) -> str:
    """An NVML error's words for a GpuUnavailable (some NVMLErrors have an empty str)."""
    text = str(exc)
    return text if text else type(exc).__name__
