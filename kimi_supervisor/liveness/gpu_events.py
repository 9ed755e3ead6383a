"""GPU XID and double-bit ECC events while serving: NVML's event set, waited on in a thread.

A GPU that reports XID 79 (fallen off the bus) or 95 (uncontained ECC) still
lets vLLM answer /health for minutes, until NCCL's own watchdog gives up.  The
driver tells us at once; this module listens and turns a device-level event on
one of our GPUs into `GpuFailed` (exit 18) in the supervisor's loop.

Only our own faults stop us.  NVML's XID events name a GPU, never a process,
and the application-scoped XIDs (NVIDIA's catalog: "restart the application";
13, 31 MMU fault, 43, 45, ...) are raised by whatever process faulted: any
local user's kernel on a shared GPU.  Those are logged, never acted on; when
the faulting process is our vLLM, vLLM fails on its own CUDA error (its fatal
record or its exit ends the run).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from kimi_supervisor.exitcodes import GpuFailed
from kimi_supervisor.host.gpu import GpuEvent, GpuEventWatch, GpuProbe, GpuUnavailable
from kimi_supervisor.logs.types import Logger

# NVIDIA's XID catalog, the ones a vLLM host meets (docs.nvidia.com/deploy/xid-errors).
XID_MEANINGS = {
    8: "GPU stopped processing (a channel idle timeout: the application's work hung)",
    11: "invalid or corrupted push buffer stream (from the application)",
    13: "graphics engine exception (often an out-of-range access by the application)",
    31: "GPU memory page fault (MMU fault: usually an illegal address in the application)",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing (the application's channel faulted)",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error (uncorrectable memory error)",
    61: "internal micro-controller breakpoint / warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded (takes effect at the next reset)",
    64: "ECC page retirement or row remapping failed",
    68: "video decoder (NVDEC) exception (the application's channel)",
    69: "graphics engine class error (the application's channel)",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the affected application must restart)",
    95: "uncontained ECC error (every application on the GPU is affected: reset the GPU)",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    154: "GPU recovery action changed (reset or reboot required)",
}

# Application-scoped: NVIDIA's catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html) gives
# "RESTART_APP" as the immediate action: the faulting application's context is lost, the GPU and every other
# process on it are fine.  Any process raises them; NVML names none.  Logged only.  Every other XID (48, 63, 64,
# 74, 79, 92, 94, 95, 109, 119, 120, 140, 154, and any not listed) is device-level: acted on unless in
# gpu_health.xid_ignored.
APPLICATION_XIDS = frozenset({8, 11, 13, 31, 43, 45, 68, 69})

WAIT_S = 0.1  # how long one NVML wait blocks: bounds how long close() waits for the thread


def describe(event: GpuEvent) -> str:
    where = f"GPU {event.gpu}" if event.gpu >= 0 else "a GPU"
    if event.kind == "xid":
        meaning = XID_MEANINGS.get(event.xid or -1, "see NVIDIA's XID catalog")
        return f"{where}: XID {event.xid}: {meaning}"
    if event.kind == "double_bit_ecc":
        return f"{where}: double-bit (uncorrectable) ECC error"
    if event.kind == "gpu_lost":
        return f"{where} is lost (NVML: GPU is lost; fallen off the bus?)"
    return f"{where}: {event.kind}"


class GpuEventWatcher:
    """Registers for events on `gpus`, waits in a daemon thread; `check()` in the loop acts on them."""

    def __init__(
        self, probe: GpuProbe, gpus: tuple[int, ...], ignored: tuple[int, ...], wake: Callable[[], None], log: Logger
    ) -> None:
        self._probe = probe
        self._gpus = gpus
        self._ignored = set(ignored)
        self._wake = wake
        self._log = log
        self._watch: GpuEventWatch | None = None
        self._queue: queue.SimpleQueue[tuple[float, GpuEvent | str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-events", daemon=True)
        self._last_error = ""

    def start(self) -> None:
        try:
            self._watch = self._probe.watch_events(self._gpus)
        except GpuUnavailable as exc:
            self._log.warning("gpu.events_unavailable", gpus=",".join(map(str, self._gpus)), error=str(exc))
            return
        registered = self._watch.registered
        self._log.info(
            "gpu.events_watching",
            registered="; ".join(f"GPU {g}: {'+'.join(k) or 'none supported'}" for g, k in sorted(registered.items())),
        )
        if not any(registered.values()):
            self._log.warning("gpu.events_unsupported", why="NVML accepted no XID or ECC event on our GPUs")
        self._thread.start()

    def _run(self) -> None:
        assert self._watch is not None
        while not self._stop.is_set():
            try:
                event = self._watch.wait(WAIT_S)
            except GpuUnavailable as exc:
                self._queue.put((time.monotonic(), str(exc)))
                self._wake()
                self._stop.wait(1.0)  # a failing wait returns at once: don't spin
                continue
            if event is not None:
                self._queue.put((time.monotonic(), event))
                self._wake()

    def check(self) -> None:
        """Log what came; raise GpuFailed for an event that is not ignored."""
        while True:
            try:
                at, item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                if item != self._last_error:
                    self._log.warning("gpu.events_wait_failed", error=item)
                self._last_error = item
                continue
            text = describe(item)
            if item.kind == "xid" and item.xid in self._ignored:
                self._log.warning(
                    "gpu.xid_ignored", gpu=item.gpu, xid=item.xid, meaning=text, why="in gpu_health.xid_ignored"
                )
                continue
            if item.kind == "xid" and item.xid in APPLICATION_XIDS:
                self._log.warning(
                    "gpu.xid_application",
                    gpu=item.gpu,
                    xid=item.xid,
                    meaning=text,
                    why="application-scoped: any process on the GPU raises it and NVML names none; "
                    "vLLM fails on its own faults",
                )
                continue
            self._log.critical(
                "gpu.xid" if item.kind == "xid" else "gpu.event",
                gpu=item.gpu,
                xid=item.xid,
                kind=item.kind,
                meaning=text,
                seen_ms=round((time.monotonic() - at) * 1000, 1),
            )
            raise GpuFailed(f"GPU failure while serving: {text}")

    def stop(self) -> None:
        """Stop acting on events; returns at once (the stop path must not wait for an NVML wait)."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(WAIT_S * 4)
        # Free the event set only once nothing waits on it any more.
        if self._watch is not None and not self._thread.is_alive():
            self._watch.close()
            self._watch = None
