"""A GpuProbe whose memory accounting follows real processes.

Each fake GPU has a base usage plus per-PID allocations; an allocation counts
only while its process is alive (a zombie counts as dead, as with the real
driver), so reaping real test processes really "returns" memory.
"""

from __future__ import annotations

import dataclasses

import psutil

from kimi_supervisor.gpu import GpuMemory, GpuProcess


@dataclasses.dataclass
class FakeGpu:
    total_mib: int = 97887  # an RTX PRO 6000: 96 GB
    base_used_mib: int = 0
    holders: dict[int, int | None] = dataclasses.field(default_factory=dict)  # pid -> MiB
    hidden_used_mib: int = 0  # memory used by processes NVML does not list


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
    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1

    def device_count(self) -> int:
        self._check()
        return len(self.gpus)

    def memory(self, index: int) -> GpuMemory:
        self._check()
        gpu = self.gpus[index]
        used = gpu.base_used_mib + gpu.hidden_used_mib
        used += sum(mib or 0 for pid, mib in gpu.holders.items() if _alive(pid))
        return GpuMemory(index, gpu.total_mib, used, gpu.total_mib - used)

    def processes(self, index: int) -> list[GpuProcess]:
        self._check()
        return [GpuProcess(pid, index, mib) for pid, mib in sorted(self.gpus[index].holders.items()) if _alive(pid)]

    def close(self) -> None:
        pass
