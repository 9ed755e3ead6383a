"""GPU access for the tier: real NVML or a fake over files, and the monitor that samples memory and /proc."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from gpuaccept.gpu_tier.common import MIB, shm_listing
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.procutil import live, proc_state

# -- GPU access: real NVML or the fake --------------------------------------------


class FakeProbe(FakeGpuProbe):
    """The tests' FakeGpuProbe, its occupants registered by other processes: a file FAKE_DIR/gpu<i>/<pid>
    holds the MiB a (fake) worker took; each counts 500 MiB more (its CUDA context) while the PID lives."""

    def __init__(self, fake_dir: str, count: int) -> None:
        super().__init__([FakeGpu(total_mib=143771) for _ in range(count)])
        self.dir = fake_dir
        self.count = count

    def _check(self) -> None:
        super()._check()
        for index, gpu in enumerate(self.gpus):
            gpu.occupants = dict(self._registered(index))

    def _registered(self, index: int) -> dict[int, int]:
        d = os.path.join(self.dir, f"gpu{index}")
        out = {}
        for name in shm_listing(d):
            if name.isdigit() and live(int(name)):
                try:
                    out[int(name)] = int(Path(d, name).read_text() or 0) + 500
                except (OSError, ValueError):
                    continue
        return out


class Gpus:
    """Raw reads for the monitor and the facts (pynvml directly, or the fake)."""

    def __init__(self, fake: FakeProbe | None) -> None:
        self.fake = fake
        if fake is None:
            import pynvml

            self.nv = pynvml
            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        else:
            self.count = fake.count

    def used_mib(self, i: int) -> int:
        if self.fake:
            return int(self.fake.memory(i).used_mib)
        info = self.nv.nvmlDeviceGetMemoryInfo(self.handles[i], version=self.nv.nvmlMemory_v2)
        return int(info.used) // MIB

    def pids(self, i: int) -> list[int]:
        if self.fake:
            return [p.pid for p in self.fake.processes(i)]
        return sorted(int(p.pid) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handles[i]))

    def facts(self, label: str) -> list[dict[str, Any]]:
        rows = []
        for i in range(self.count):
            if self.fake:
                m = self.fake.memory(i)
                rows.append(
                    {
                        "gpu": i,
                        "when": label,
                        "fake": True,
                        "v2_used_mib": m.used_mib,
                        "procs": [{"pid": p.pid, "used_mib": p.used_mib} for p in self.fake.processes(i)],
                    }
                )
                continue
            nv, h = self.nv, self.handles[i]
            v1 = nv.nvmlDeviceGetMemoryInfo(h)
            row: dict[str, Any] = {
                "gpu": i,
                "when": label,
                "name": _s(nv.nvmlDeviceGetName(h)),
                "v1_total_mib": v1.total // MIB,
                "v1_used_mib": v1.used // MIB,
                "v1_free_mib": v1.free // MIB,
            }
            try:
                v2 = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                row.update(
                    v2_total_mib=v2.total // MIB,
                    v2_used_mib=v2.used // MIB,
                    v2_reserved_mib=v2.reserved // MIB,
                    v2_free_mib=v2.free // MIB,
                )
            except nv.NVMLError as exc:
                row["v2_error"] = str(exc)
            procs = []
            for kind, getter in (
                ("compute", nv.nvmlDeviceGetComputeRunningProcesses),
                ("graphics", nv.nvmlDeviceGetGraphicsRunningProcesses),
            ):
                try:
                    entries = getter(h)
                except nv.NVMLError as exc:
                    procs.append({"kind": kind, "error": str(exc)})
                    continue
                for e in entries:
                    used = e.usedGpuMemory
                    procs.append(
                        {
                            "kind": kind,
                            "pid": int(e.pid),
                            "used_mib": (int(used) // MIB) if isinstance(used, int) else None,
                            "in_proc": os.path.exists(f"/proc/{int(e.pid)}"),
                            "comm": comm(int(e.pid)),
                        }
                    )
            row["procs"] = procs
            rows.append(row)
        return rows

    def close(self) -> None:
        if not self.fake:
            with contextlib.suppress(Exception):
                self.nv.nvmlShutdown()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


# -- the monitor: NVML memory and /proc state, sampled every few ms ------------------


class Monitor(threading.Thread):
    def __init__(self, gpus: Gpus, pids: list[int], period_s: float = 0.005, with_nvml_pids: bool = True) -> None:
        super().__init__(daemon=True)
        self.gpus = gpus
        self.pids = pids
        self.period = period_s
        self.with_nvml_pids = with_nvml_pids
        self.stop_evt = threading.Event()
        self.lock = threading.Lock()
        self.mem: list[tuple[float, list[int]]] = []
        self.states: dict[int, list[tuple[float, str]]] = {p: [] for p in pids}
        self.nvml_pids: list[tuple[float, list[list[int]]]] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_evt.is_set():
            t = time.monotonic()
            try:
                used = [self.gpus.used_mib(i) for i in range(self.gpus.count)]
                with self.lock:
                    self.mem.append((t, used))
                if self.with_nvml_pids:
                    nv = [self.gpus.pids(i) for i in range(self.gpus.count)]
                    with self.lock:
                        if not self.nvml_pids or self.nvml_pids[-1][1] != nv:
                            self.nvml_pids.append((t, nv))
            except Exception as exc:
                if len(self.errors) < 5:
                    self.errors.append(repr(exc))
            for p in self.pids:
                s = proc_state(p)
                hist = self.states[p]
                if not hist or hist[-1][1] != s:
                    hist.append((t, s))
            self.stop_evt.wait(self.period)

    def stop(self) -> None:
        self.stop_evt.set()
        self.join(5)

    def first_mem_at_or_below(self, gpu: int, limit: int, after: float) -> float | None:
        with self.lock:
            for t, used in self.mem:
                if t >= after and used[gpu] <= limit:
                    return t
        return None

    def first_state(self, pid: int, states: str, after: float = 0.0) -> float | None:
        for t, s in self.states.get(pid, []):
            if t >= after and s in states:
                return t
        return None

    def nvml_pid_gone(self, gpu: int, pid: int, after: float) -> float | None:
        with self.lock:
            for t, lists in self.nvml_pids:
                if t >= after and pid not in lists[gpu]:
                    return t
        return None


# -- the bench -------------------------------------------------------------------------
