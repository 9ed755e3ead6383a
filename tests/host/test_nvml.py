"""NvmlProbe: no driver is a GpuUnavailable with words, never a traceback; v2 memory falls back to v1."""

from __future__ import annotations

import types

import pynvml
import pytest

from kimi_supervisor.host.gpu import MIB, GpuUnavailable
from kimi_supervisor.host.nvml import NvmlProbe


def test_no_driver_here_is_a_clear_error() -> None:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    except pynvml.NVMLError:
        pass
    with pytest.raises(GpuUnavailable, match=r"^NVML unavailable: .+ \(is the NVIDIA driver loaded\?\)$"):
        NvmlProbe().device_count()


def fake_nvml(monkeypatch: pytest.MonkeyPatch, v2_error: int | None) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"h{i}")

    def meminfo(handle: str, version: int | None = None) -> types.SimpleNamespace:
        if version is not None:
            if v2_error is not None:
                raise pynvml.NVMLError(v2_error)
            return types.SimpleNamespace(total=1000 * MIB, used=0, free=1000 * MIB)  # v2: reserved excluded
        return types.SimpleNamespace(total=1000 * MIB, used=615 * MIB, free=385 * MIB)

    def procs(handle: str) -> list[types.SimpleNamespace]:
        return [
            types.SimpleNamespace(pid=42, usedGpuMemory=5110 * MIB),
            types.SimpleNamespace(pid=43, usedGpuMemory=None),
        ]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", meminfo)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", procs)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", lambda h: [])


def test_v2_memory_is_used_when_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, None)
    probe = NvmlProbe()
    assert probe.memory(0).used_mib == 0
    assert [(p.pid, p.used_mib) for p in probe.processes(0)] == [(42, 5110), (43, None)]


def test_v1_fallback_when_v2_not_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, pynvml.NVML_ERROR_NOT_SUPPORTED)
    probe = NvmlProbe()
    assert probe.memory(0).used_mib == 615
    assert probe.memory(0).used_mib == 615  # remembered: v2 is not tried again


def test_other_nvml_errors_are_gpu_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuUnavailable, match=r"^GPU 0 memory: "):
        NvmlProbe().memory(0)
