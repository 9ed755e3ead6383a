"""NVML's health counters and critical events, behind `NvmlProbe.health` and `NvmlProbe.watch_events`.

Every query is optional hardware support: a GPU that answers "not supported"
(retired pages on Ampere and later, remapped rows before it, ECC on GeForce
cards) gets None, which the report shows as "n/a", never as a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pynvml

from kimi_supervisor.host.gpu import GpuActivity, GpuEvent, GpuHealth, GpuUnavailable, nvml_text

_T = TypeVar("_T")

# What we register for, and what the event means when it comes.
EVENT_KINDS = {
    pynvml.nvmlEventTypeXidCriticalError: "xid",
    pynvml.nvmlEventTypeDoubleBitEccError: "double_bit_ecc",
}


def read_health(handle: object, index: int) -> GpuHealth:
    errors: dict[str, str] = {}

    def ask(field: str, query: Callable[[], _T]) -> _T | None:
        try:
            return query()
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return None
        except pynvml.NVMLError as exc:
            errors[field] = nvml_text(exc)
            return None

    def retired() -> int:
        return sum(
            len(pynvml.nvmlDeviceGetRetiredPages(handle, cause))
            for cause in (
                pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
            )
        )

    rows = ask("remapped_rows", lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    pending = ask("retired_pages_pending", lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    persistence = ask("persistence_mode", lambda: pynvml.nvmlDeviceGetPersistenceMode(handle))
    return GpuHealth(
        index=index,
        retired_pages=ask("retired_pages", retired),
        retired_pages_pending=None if pending is None else bool(pending),
        remapped_rows_correctable=None if rows is None else int(rows[0]),
        remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
        remapped_rows_pending=None if rows is None else bool(rows[2]),
        remapped_rows_failed=None if rows is None else bool(rows[3]),
        ecc_uncorrected_volatile=ask(
            "ecc_uncorrected_volatile",
            lambda: int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            ),
        ),
        pcie_width=ask("pcie_width", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))),
        pcie_max_width=ask("pcie_max_width", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))),
        pcie_gen=ask("pcie_gen", lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))),
        pcie_max_gen=ask("pcie_max_gen", lambda: int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))),
        persistence_mode=None if persistence is None else persistence == pynvml.NVML_FEATURE_ENABLED,
        clock_event_reasons=ask("clock_event_reasons", lambda: _clock_reasons(handle)),
        errors=errors,
    )


def read_activity(handle: object, index: int) -> GpuActivity:
    errors: dict[str, str] = {}

    def ask(field: str, query: Callable[[], int]) -> int | None:
        try:
            return int(query())
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return None
        except pynvml.NVMLError as exc:
            errors[field] = nvml_text(exc)
            return None

    rates = None
    try:
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        pass
    except pynvml.NVMLError as exc:
        errors["utilization"] = nvml_text(exc)
    return GpuActivity(
        index=index,
        gpu_util_pct=None if rates is None else int(rates.gpu),
        memory_util_pct=None if rates is None else int(rates.memory),
        sm_clock_mhz=ask("sm_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        memory_clock_mhz=ask("memory_clock_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
        errors=errors,
    )


def _clock_reasons(handle: object) -> int:
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError_FunctionNotFound:  # drivers before 535 only have the old name
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _address(handle: object) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value  # type: ignore[arg-type]
    except (TypeError, ctypes.ArgumentError):
        return None


class NvmlEventWatch:
    """One NVML event set over our GPUs: XID critical errors and double-bit ECC where supported."""

    def __init__(self, handles: Mapping[int, object]) -> None:
        try:
            self._set: Any = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML event set: {nvml_text(exc)}") from None
        self._by_address: dict[int, int] = {}
        registered: dict[int, tuple[str, ...]] = {}
        for index, handle in handles.items():
            address = _address(handle)
            if address is not None:
                self._by_address[address] = index
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            except pynvml.NVMLError:
                supported = sum(EVENT_KINDS)  # unknown: try both, registration says what holds
            kinds: list[str] = []
            for mask, kind in EVENT_KINDS.items():
                if not supported & mask:
                    continue
                try:
                    pynvml.nvmlDeviceRegisterEvents(handle, mask, self._set)
                    kinds.append(kind)
                except pynvml.NVMLError:
                    continue  # not supported on this GPU or in this VM: said by `registered`
            registered[index] = tuple(kinds)
        self.registered: Mapping[int, tuple[str, ...]] = registered

    def wait(self, timeout_s: float) -> GpuEvent | None:
        try:
            data = pynvml.nvmlEventSetWait_v2(self._set, max(1, int(timeout_s * 1000)))
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError_GpuIsLost:
            return GpuEvent(gpu=-1, kind="gpu_lost")
        except pynvml.NVMLError as exc:
            raise GpuUnavailable(f"NVML event wait: {nvml_text(exc)}") from None
        gpu = self._by_address.get(_address(data.device) or 0, -1)
        kind = EVENT_KINDS.get(int(data.eventType), f"event 0x{int(data.eventType):x}")
        return GpuEvent(gpu=gpu, kind=kind, xid=int(data.eventData) if kind == "xid" else None)

    def close(self) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlEventSetFree(self._set)
