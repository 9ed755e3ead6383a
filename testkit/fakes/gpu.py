"""A GpuProbe whose memory accounting follows real processes.

Each fake GPU has a base usage plus per-PID allocations; an allocation counts
only while its process is alive (a zombie counts as dead, as with the real
driver), so reaping real test processes really "returns" memory.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Mapping

import psutil

from kimi_supervisor.host.gpu import GpuActivity, GpuEvent, GpuHealth, GpuMemory, GpuProcess, GpuUnavailable

# An H200 in good shape, as NVML reports it (gpuaccept/results/gpu_health_h200.md).
HEALTHY = GpuHealth(
    index=0,
    remapped_rows_correctable=0,
    remapped_rows_uncorrectable=0,
    remapped_rows_pending=False,
    remapped_rows_failed=False,
    ecc_uncorrected_volatile=0,
    pcie_width=16,
    pcie_max_width=16,
    pcie_gen=5,
    pcie_max_gen=5,
    persistence_mode=True,
    clock_event_reasons=0,
)


# An H200 mid-decode: kernels running, base clocks.
BUSY = GpuActivity(index=0, gpu_util_pct=100, memory_util_pct=37, sm_clock_mhz=1980, memory_clock_mhz=3201)


@dataclasses.dataclass
class FakeGpu:
    total_mib: int = 97887  # an RTX PRO 6000: 96 GB
    base_used_mib: int = 0
    occupants: dict[int, int | None] = dataclasses.field(default_factory=dict)  # pid -> MiB
    hidden_used_mib: int = 0  # memory used by processes NVML does not list
    health: GpuHealth = HEALTHY  # its index is replaced by the GPU's
    activity: GpuActivity = BUSY  # its index is replaced by the GPU's


# Above the kernel's PID limit: a "host PID" NVML reports that never exists here.
INVISIBLE_PID = 4_194_400


def _alive(pid: int) -> bool:
    if pid >= INVISIBLE_PID:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class FakeGpuProbe:
    def __init__(self, gpus: list[FakeGpu], alive: Callable[[int], bool] | None = None) -> None:
        self.gpus = gpus
        self._alive = alive or _alive  # a fake process table's liveness, for scenes without real processes
        self.calls = 0
        self.events: queue.SimpleQueue[GpuEvent] = queue.SimpleQueue()
        self.event_kinds: tuple[str, ...] = ("xid", "double_bit_ecc")  # what "the driver" accepts
        self.event_error: str | None = None  # watch_events raises GpuUnavailable with this
        self.watches: list[FakeEventWatch] = []

    def inject(self, event: GpuEvent) -> None:
        """As if the driver reported `event`: a watch over that GPU returns it from wait()."""
        self.events.put(event)

    def _check(self) -> None:
        self.calls += 1

    def device_count(self) -> int:
        self._check()
        return len(self.gpus)

    def memory(self, index: int) -> GpuMemory:
        self._check()
        gpu = self.gpus[index]
        used = gpu.base_used_mib + gpu.hidden_used_mib
        used += sum(mib or 0 for pid, mib in gpu.occupants.items() if self._alive(pid))
        return GpuMemory(index, gpu.total_mib, used, gpu.total_mib - used)

    def processes(self, index: int) -> list[GpuProcess]:
        self._check()
        return [
            GpuProcess(pid, index, mib) for pid, mib in sorted(self.gpus[index].occupants.items()) if self._alive(pid)
        ]

    def health(self, index: int) -> GpuHealth:
        self._check()
        return dataclasses.replace(self.gpus[index].health, index=index)

    def activity(self, index: int) -> GpuActivity:
        self._check()
        return dataclasses.replace(self.gpus[index].activity, index=index)

    def watch_events(self, indices: tuple[int, ...]) -> FakeEventWatch:
        self._check()
        if self.event_error is not None:
            raise GpuUnavailable(self.event_error)
        watch = FakeEventWatch(self, {i: self.event_kinds for i in indices})
        self.watches.append(watch)
        return watch

    def close(self) -> None:
        pass


class FakeEventWatch:
    def __init__(self, probe: FakeGpuProbe, registered: Mapping[int, tuple[str, ...]]) -> None:
        self._probe = probe
        self.registered = registered
        self.closed = False

    def wait(self, timeout_s: float) -> GpuEvent | None:
        try:
            event = self._probe.events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        # NVML delivers only events of the devices registered on the set.
        return event if event.gpu in self.registered or event.gpu < 0 else None

    def close(self) -> None:
        self.closed = True
