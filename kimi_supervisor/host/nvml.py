"""`NvmlProbe`: the GpuProbe over pynvml (its health counters and events: nvml_counters.py).

Memory is counted the way nvidia-smi shows it: NVML's v2 memory info, whose
`used` leaves out the driver-reserved part (an idle H200 reads v1 used=615 MiB,
v2 used=0 with reserved=615).  Where v2 is not supported we fall back to v1.
"""

from __future__ import annotations

import contextlib
import threading

from kimi_supervisor.host.gpu import (
    MIB,
    GpuActivity,
    GpuEventWatch,
    GpuHealth,
    GpuMemory,
    GpuProcess,
    GpuUnavailable,
    nvml_text,
)


class NvmlProbe:
    """GpuProbe over pynvml; initialises NVML lazily and once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: dict[int, object] = {}
        self._v2_supported = True

    def _init(self) -> None:
        if self._initialised:
            return
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - dependency missing
            raise GpuUnavailable(f"the NVML bindings are not installed (pip install nvidia-ml-py): {exc}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML unavailable: {nvml_text(exc)} (is the NVIDIA driver loaded?)") from None
        self._initialised = True

    def _handle(self, index: int) -> object:
        import pynvml

        self._init()
        if index not in self._handles:
            try:
                self._handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as exc:
                raise GpuUnavailable(f"GPU {index}: {nvml_text(exc)}") from None
        return self._handles[index]

    def device_count(self) -> int:
        import pynvml

        with self._lock:
            self._init()
            try:
                return int(pynvml.nvmlDeviceGetCount())
            except pynvml.NVMLError as exc:
                raise GpuUnavailable(f"NVML device count: {nvml_text(exc)}") from None

    def memory(self, index: int) -> GpuMemory:
        import pynvml

        with self._lock:
            handle = self._handle(index)
            info = None
            if self._v2_supported:
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                except pynvml.NVMLError as exc:
                    # Older drivers: v2 is refused; remember and use v1.
                    if not isinstance(
                        exc,
                        (
                            pynvml.NVMLError_NotSupported,
                            pynvml.NVMLError_FunctionNotFound,
                            pynvml.NVMLError_ArgumentVersionMismatch,
                        ),
                    ):
                        raise GpuUnavailable(f"GPU {index} memory: {nvml_text(exc)}") from None
                    self._v2_supported = False
            if info is None:
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                except pynvml.NVMLError as exc:
                    raise GpuUnavailable(f"GPU {index} memory: {nvml_text(exc)}") from None
            return GpuMemory(index, int(info.total) // MIB, int(info.used) // MIB, int(info.free) // MIB)

    def processes(self, index: int) -> list[GpuProcess]:
        import pynvml

        with self._lock:
            handle = self._handle(index)
            found: dict[int, GpuProcess] = {}
            for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    entries = getter(handle)
                except pynvml.NVMLError_NotSupported:
                    continue
                except pynvml.NVMLError as exc:
                    raise GpuUnavailable(f"GPU {index} processes: {nvml_text(exc)}") from None
                for entry in entries:
                    used = entry.usedGpuMemory
                    # NVML reports "not available" as None or a huge sentinel.
                    mib = int(used) // MIB if isinstance(used, int) and used < (1 << 50) else None
                    found[int(entry.pid)] = GpuProcess(int(entry.pid), index, mib)
            return sorted(found.values(), key=lambda p: p.pid)

    def health(self, index: int) -> GpuHealth:
        # pynvml is imported only when a probe is used: the CLI without the bindings still says why.
        from kimi_supervisor.host import nvml_counters

        with self._lock:
            return nvml_counters.read_health(self._handle(index), index)

    def activity(self, index: int) -> GpuActivity:
        from kimi_supervisor.host import nvml_counters

        with self._lock:
            return nvml_counters.read_activity(self._handle(index), index)

    def watch_events(self, indices: tuple[int, ...]) -> GpuEventWatch:
        from kimi_supervisor.host import nvml_counters

        with self._lock:
            handles = {i: self._handle(i) for i in indices}
            return nvml_counters.NvmlEventWatch(handles)

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                # Imported only when NVML was used: a front that dropped root (docs/front.md) never loaded it and
                # may not be allowed to read it now.
                import pynvml

                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialised = False
                self._handles.clear()
