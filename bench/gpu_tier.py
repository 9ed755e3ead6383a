#!/usr/bin/env python3
"""The real-GPU tier of kimi-supervisor: NVML facts, orphan reaping, stop, benchmark.

    python3 bench/gpu_tier.py --out DIR [--mib 4096] [--reps 20] [--fake]

Writes DIR/gpu_tier.json and DIR/gpu_tier.md and prints a readable report.

  a. NVML facts per GPU: v1 vs v2 memory, compute-process PIDs vs ours, /proc.
  b. Orphans: a stale parent spawns one torch worker per GPU (comm
     VLLM::Worker_TP<i>, NCCL group on 2+ GPUs, MIB MiB each), then is
     SIGKILLed; decoys that must survive; stale/held shm files; the supervisor's
     Preflight dry run, then the real run, timed against NVML and /proc.
     Then a GPU holder that matches no kill rule: the preflight must fail and
     kill nothing.
  c. The real CLI supervising bench/gpu_child.py: ready, SIGTERM, tree gone,
     GPUs free, exit code.
  d. Preflight wall time on clean GPUs vs the seeds' nvidia-smi bash loop;
     NVML and nvidia-smi call latency.

--fake runs the same orchestration with no GPU (a probe that counts live
worker PIDs as memory) to test this script's logic on a CPU machine.
Every process this script signals is one it started (or one the supervisor's
preflight reaps, which are the orphaned workers this script started).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import io
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Mandatory on the multi-GPU machines: NVLink multicast stays off everywhere,
# also in every process started from here (they inherit os.environ).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
MIB = 1024 * 1024
THRESHOLD_MIB = 1000  # the supervisor's default preflight.memory_threshold_mib


# ============================================================================
# helpers run in subprocesses (workers, parent, decoys, holder)
# ============================================================================


def set_comm(name: str) -> None:
    raw = name.encode()[:15]
    libc = ctypes.CDLL(None, use_errno=True)
    if int(libc.prctl(15, ctypes.c_char_p(raw), 0, 0, 0)) != 0:  # PR_SET_NAME
        with open("/proc/self/comm", "wb") as fh:
            fh.write(raw)


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _shm_listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def hold_gpu_memory(a: argparse.Namespace) -> Any:
    """Take a.mib MiB on a.gpu (a torch tensor); with --fake-dir, a file the fake probe counts instead."""
    if a.fake_dir:
        d = os.path.join(a.fake_dir, f"gpu{a.gpu}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, str(os.getpid())), "w") as fh:
            fh.write(str(a.mib))
        return None
    import torch

    torch.cuda.set_device(a.gpu)
    return torch.empty(a.mib * MIB, dtype=torch.uint8, device=f"cuda:{a.gpu}")


def sub_worker(a: argparse.Namespace) -> int:
    """One 'TP worker': comm name, MIB MiB on its GPU, NCCL all_reduce, sleep."""
    set_comm(a.name)
    info: dict[str, Any] = {"pid": os.getpid(), "rank": a.rank, "gpu": a.gpu, "comm_set": a.name}
    hold = hold_gpu_memory(a)
    if not a.fake_dir:
        import torch

        info["held_bytes"] = hold.numel()
        if a.world > 1:
            import torch.distributed as dist

            t0 = time.monotonic()
            dist.init_process_group(
                "nccl",
                init_method=f"tcp://127.0.0.1:{a.master_port}",
                rank=a.rank,
                world_size=a.world,
                device_id=torch.device("cuda", a.gpu),
            )
            t = torch.ones(1 << 20, device=f"cuda:{a.gpu}")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            info["allreduce_ok"] = float(t[0].item()) == float(a.world)
            info["nccl_init_allreduce_s"] = round(time.monotonic() - t0, 3)
            with contextlib.suppress(Exception):
                v = torch.cuda.nccl.version()
                info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        torch.cuda.synchronize()
        info["torch"] = torch.__version__
    info["shm_after_init"] = _shm_listing(a.shm_dir)
    _write_json(a.ready, info)
    while True:
        time.sleep(3600)


def sub_parent(a: argparse.Namespace) -> int:
    """The stale tree's root: spawns one worker per GPU, waits, sleeps until SIGKILLed."""
    set_comm("stale_parent")
    port = _free_port()
    procs = []
    for rank in range(a.world):
        ready = os.path.join(a.state, f"worker{rank}.ready")
        cmd = [
            sys.executable,
            str(HERE),
            "_worker",
            "--rank",
            str(rank),
            "--gpu",
            str(rank),
            "--world",
            str(a.world),
            "--mib",
            str(a.mib),
            "--master-port",
            str(port),
            "--ready",
            ready,
            "--name",
            f"VLLM::Worker_TP{rank}",
            "--shm-dir",
            a.shm_dir,
        ]
        if a.fake_dir:
            cmd += ["--fake-dir", a.fake_dir]
        log = open(os.path.join(a.state, f"worker{rank}.log"), "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env()))
    while not all(os.path.exists(os.path.join(a.state, f"worker{r}.ready")) for r in range(a.world)):
        if any(p.poll() is not None for p in procs):
            _write_json(os.path.join(a.state, "parent.failed"), {"codes": [p.poll() for p in procs]})
            return 1
        time.sleep(0.05)
    _write_json(os.path.join(a.state, "parent.ready"), {"pid": os.getpid(), "workers": [p.pid for p in procs]})
    while True:
        time.sleep(3600)


def sub_decoy_ctl(a: argparse.Namespace) -> int:
    """Opens /dev/nvidiactl and /dev/nvidia0 (no CUDA context) and holds a shm file open."""
    set_comm("decoy_ctl")
    held = []
    for dev in a.dev:
        try:
            held.append(os.open(dev, os.O_RDWR))
        except OSError as exc:
            held.append(None)
            print(f"decoy_ctl: cannot open {dev}: {exc}", file=sys.stderr)
    fd = os.open(a.hold, os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, b"held by decoy_ctl\n")
    _write_json(
        a.ready, {"pid": os.getpid(), "devices": [d for d, h in zip(a.dev, held, strict=False) if h is not None]}
    )
    while True:
        time.sleep(3600)


def sub_holder(a: argparse.Namespace) -> int:
    """A GPU holder whose name matches no kill rule (a 'trainer')."""
    set_comm("trainer")
    hold = hold_gpu_memory(a)
    if not a.fake_dir:
        import torch

        torch.cuda.synchronize()
        assert hold.numel() > 0
    _write_json(a.ready, {"pid": os.getpid()})
    while True:
        time.sleep(3600)


# The vllm-looking decoy: `python3 -c CODE vllm serve` named VLLM::Worker_TP9, no GPU.
DECOY_VLLM_CODE = (
    "import ctypes,json,os,sys,time;"
    "ctypes.CDLL(None).prctl(15,ctypes.c_char_p(b'VLLM::Worker_TP9'[:15]),0,0,0);"
    "p=os.environ['DECOY_READY'];open(p+'.tmp','w').write(json.dumps({'pid':os.getpid()}));os.replace(p+'.tmp',p);"
    "time.sleep(86400)"
)


# ============================================================================
# the bench process
# ============================================================================


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    # NCCL over /dev/shm: no P2P, SHM transport on, legacy (file-backed) host buffers.
    env.setdefault("NCCL_P2P_DISABLE", "1")
    env.setdefault("NCCL_SHM_DISABLE", "0")
    env.setdefault("NCCL_CUMEM_HOST_ENABLE", "0")
    if extra:
        env.update(extra)
    return env


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "n": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "p95": pct(values, 0.95),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def proc_state(pid: int) -> str:
    """The /proc state letter, or '-' when the PID is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode()
    except (OSError, ValueError):
        return "-"


def proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def live(pid: int) -> bool:
    return proc_state(pid) not in ("-", "Z", "X")


class Tee(io.TextIOBase):
    """Where structlog writes: stderr and a list we keep for the report."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, s: str) -> int:
        sys.stderr.write(s)
        self.lines.extend(x for x in s.splitlines() if x.strip())
        return len(s)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False


# -- GPU access: real NVML or the fake --------------------------------------------


class FakeProbe:
    """GpuProbe over files FAKE_DIR/gpu<i>/<pid> (MiB): memory counts while the PID lives."""

    def __init__(self, fake_dir: str, count: int) -> None:
        self.dir = fake_dir
        self.count = count
        self.total = 143771

    def _holders(self, index: int) -> dict[int, int]:
        d = os.path.join(self.dir, f"gpu{index}")
        out = {}
        for name in _shm_listing(d):
            if name.isdigit() and live(int(name)):
                try:
                    out[int(name)] = int(Path(d, name).read_text() or 0) + 500
                except (OSError, ValueError):
                    continue
        return out

    def device_count(self) -> int:
        return self.count

    def memory(self, index: int) -> Any:
        from kimi_supervisor.gpu import GpuMemory

        used = sum(self._holders(index).values())
        return GpuMemory(index, self.total, used, self.total - used)

    def processes(self, index: int) -> list[Any]:
        from kimi_supervisor.gpu import GpuProcess

        return [GpuProcess(pid, index, mib) for pid, mib in sorted(self._holders(index).items())]

    def close(self) -> None:
        pass


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
                            "comm": _comm(int(e.pid)),
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


def _comm(pid: int) -> str | None:
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


@dataclasses.dataclass
class Ctx:
    out: Path
    fake: bool
    mib: int
    reps: int
    ngpu: int
    gpus: Gpus
    probe: Any  # GpuProbe for Preflight
    shm_dir: str
    state: Path
    fake_dir: str | None
    started: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)
    log_tee: Tee | None = None

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def spawn(self, cmd: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.state / log_name, "wb")
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env or _child_env(), start_new_session=True, cwd=REPO
        )
        self.started.append(p)
        return p


def wait_file(path: Path, timeout: float, watch: list[subprocess.Popen[bytes]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        for p in watch:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.pid} exited with {p.returncode} before {path.name} appeared")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout:g}s")


def log_tail(ctx: Ctx, name: str, n: int = 30) -> str:
    try:
        return "\n".join((ctx.state / name).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def make_config(ctx: Ctx, *, deadline_s: float = 30.0, port: int | None = None, tp: int | None = None) -> Any:
    from kimi_supervisor.config import parse_config

    port = port or _free_port()
    data = {
        "child": {
            "argv": [
                "python3",
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "/tmp/x",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--tensor-parallel-size",
                str(tp or ctx.ngpu),
            ],
        },
        "preflight": {
            "gpus": list(range(ctx.ngpu)),
            "check_model": False,
            "deadline_s": deadline_s,
            "poll_interval_s": 0.1,
            "busy_log_interval_s": 2.0,
            "reap": {"grace_s": 10.0},
            "shm": {"directory": ctx.shm_dir},
        },
    }
    return parse_config(data, Path("gpu-tier"))


class TimingTable:
    """PsutilProcessTable that records when each signal was sent (delegation, no edits)."""

    def __init__(self) -> None:
        from kimi_supervisor.proctable import PsutilProcessTable

        self.inner = PsutilProcessTable()
        self.sent: list[tuple[float, int, str]] = []

    def get(self, pid: int) -> Any:
        return self.inner.get(pid)

    def all(self) -> Any:
        return self.inner.all()

    def open_paths(self, prefixes: tuple[str, ...]) -> Any:
        return self.inner.open_paths(prefixes)

    def alive(self, proc: Any) -> bool:
        return self.inner.alive(proc)

    def signal(self, proc: Any, sig: signal.Signals) -> bool:
        t = time.monotonic()
        ok = self.inner.signal(proc, sig)
        if ok:
            self.sent.append((t, proc.pid, sig.name))
        return ok


# -- a: NVML facts ---------------------------------------------------------------------


def step_facts_idle(ctx: Ctx) -> None:
    print("\n== a. NVML facts (idle) ==", flush=True)
    meta: dict[str, Any] = {}
    if not ctx.fake:
        nv = ctx.gpus.nv
        meta["driver"] = _s(nv.nvmlSystemGetDriverVersion())
        meta["nvml"] = _s(nv.nvmlSystemGetNVMLVersion())
        with contextlib.suppress(Exception):
            meta["cuda_driver"] = nv.nvmlSystemGetCudaDriverVersion()
    meta["nvidia_ml_py"] = _pkg_version("nvidia-ml-py")
    meta["psutil"] = _pkg_version("psutil")
    meta["structlog"] = _pkg_version("structlog")
    ctx.result["meta"].update(meta)
    ctx.result["facts"] = {"idle": ctx.gpus.facts("idle")}
    for r in ctx.result["facts"]["idle"]:
        print(f"  {json.dumps(r)}", flush=True)


def _pkg_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# -- b: orphans -------------------------------------------------------------------------


def step_orphans(ctx: Ctx) -> None:
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.journal import get_logger
    from kimi_supervisor.preflight import Preflight
    from kimi_supervisor.report import render_text

    print("\n== b. orphans + decoys ==", flush=True)
    res: dict[str, Any] = {}
    ctx.result["orphans"] = res
    shm = Path(ctx.shm_dir)
    shm_before = set(_shm_listing(ctx.shm_dir))
    res["shm_before"] = sorted(shm_before)

    # Decoys, each in its own session (as unrelated services would be).
    devs = ["/dev/nvidiactl", "/dev/nvidia0"] if not ctx.fake else ["/dev/null"]
    held = shm / "psm_test_held"
    stale = shm / "psm_test_stale"
    d_ctl = ctx.spawn(
        [sys.executable, str(HERE), "_decoy_ctl", "--ready", str(ctx.state / "decoy_ctl.ready"), "--hold", str(held)]
        + [x for d in devs for x in ("--dev", d)],
        "decoy_ctl.log",
    )
    d_vllm = ctx.spawn(
        [sys.executable, "-c", DECOY_VLLM_CODE, "vllm", "serve"],
        "decoy_vllm.log",
        env=_child_env({"DECOY_READY": str(ctx.state / "decoy_vllm.ready")}),
    )
    stale.write_bytes(b"stale psm file nobody holds\n")
    wait_file(ctx.state / "decoy_ctl.ready", 30, [d_ctl])
    wait_file(ctx.state / "decoy_vllm.ready", 30, [d_vllm])
    decoys = {"decoy_ctl": d_ctl.pid, "decoy_vllm": d_vllm.pid}

    # The stale tree.
    t0 = time.monotonic()
    cmd = [sys.executable, str(HERE), "_parent", "--world", str(ctx.ngpu), "--mib", str(ctx.mib)]
    cmd += ["--state", str(ctx.state), "--shm-dir", ctx.shm_dir]
    if ctx.fake_dir:
        cmd += ["--fake-dir", ctx.fake_dir]
    parent = ctx.spawn(cmd, "parent.log")
    try:
        pinfo = wait_file(ctx.state / "parent.ready", 150, [parent])
    except Exception:
        for r in range(ctx.ngpu):
            print(f"--- worker{r}.log ---\n{log_tail(ctx, f'worker{r}.log')}", flush=True)
        raise
    res["tree_start_s"] = round(time.monotonic() - t0, 2)
    workers = [int(p) for p in pinfo["workers"]]
    winfo = [json.loads((ctx.state / f"worker{r}.ready").read_text()) for r in range(ctx.ngpu)]
    res["workers"] = winfo
    res["parent_pid"] = parent.pid
    res["decoys"] = decoys
    print(f"  tree up in {res['tree_start_s']}s: parent {parent.pid}, workers {workers}", flush=True)

    # What psutil and /proc show for the workers and decoys.
    import psutil

    names = {}
    for label, pid in [*(("worker", w) for w in workers), *decoys.items()]:
        p = psutil.Process(pid)
        names[str(pid)] = {
            "role": label,
            "psutil_name": p.name(),
            "comm": _comm(pid),
            "cmdline": p.cmdline(),
        }
    res["names"] = names
    for pid, n in names.items():
        print(f"  PID {pid} {n['role']}: name()={n['psutil_name']!r} comm={n['comm']!r} cmdline={n['cmdline'][:4]}")

    # a (under load): NVML lists our PIDs?
    ctx.result["facts"]["loaded"] = ctx.gpus.facts("loaded")
    listed: dict[int, list[int]] = {}
    for row in ctx.result["facts"]["loaded"]:
        listed[row["gpu"]] = sorted(p["pid"] for p in row.get("procs", []) if "pid" in p)
        print(f"  {json.dumps(row)}", flush=True)
    res["nvml_listed"] = {str(k): v for k, v in listed.items()}
    for r, w in enumerate(workers):
        ctx.expect(f"NVML lists worker PID {w} on GPU {r}", w in listed.get(r, []), f"listed={listed.get(r)}")
        others = [g for g, pids in listed.items() if w in pids and g != r]
        res.setdefault("worker_on_other_gpus", {})[str(w)] = others
    ctx.expect(
        "NVML PIDs are visible in /proc (same PID namespace)",
        all(os.path.exists(f"/proc/{p}") for pids in listed.values() for p in pids),
    )
    ctx.expect("decoys hold no CUDA context", not any(d in pids for pids in listed.values() for d in decoys.values()))
    if ctx.ngpu > 1 and not ctx.fake:
        ctx.expect("NCCL all_reduce gave the right sum", all(w.get("allreduce_ok") for w in winfo))
    new_shm = sorted(set(_shm_listing(ctx.shm_dir)) - shm_before - {"psm_test_held", "psm_test_stale"})
    res["shm_new_with_tree"] = new_shm
    res["shm_seen_by_workers"] = sorted({f for w in winfo for f in w.get("shm_after_init", [])} - shm_before)
    res["nccl_transport_lines"] = _nccl_transport(ctx)
    print(f"  new /dev/shm files while the tree runs: {new_shm}", flush=True)

    # Orphan them.
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    time.sleep(0.3)
    res["orphan_ppids"] = {str(w): proc_ppid(w) for w in workers}
    res["shm_after_orphaning"] = sorted(set(_shm_listing(ctx.shm_dir)) - shm_before)
    used = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_orphaned"] = used
    print(f"  parent SIGKILLed; orphans' ppid now {res['orphan_ppids']}; used MiB {used}", flush=True)
    ctx.expect("orphans keep their memory", all(u > THRESHOLD_MIB for u in used), f"used={used}")
    ctx.expect("orphans alive", all(live(w) for w in workers))

    cfg = make_config(ctx)
    log = get_logger()

    # Dry run.
    table = TimingTable()
    t = time.monotonic()
    dry = Preflight(cfg, ctx.probe, table, SystemClock(), log).run(dry_run=True)
    res["dry_run_s"] = round(time.monotonic() - t, 4)
    text = render_text(dry, "gpu-tier")
    res["dry_run_report"] = text.splitlines()
    res["dry_run"] = dry.to_dict()
    print(text, flush=True)
    would_kill = sorted(c.data["pid"] for c in dry.checks if c.name == "reap" and c.status.value == "would kill")
    ctx.expect("dry run: 'would kill' lists exactly the orphans", would_kill == sorted(workers), f"{would_kill}")
    ctx.expect("dry run signalled nothing", not table.sent)
    ctx.expect("dry run verdict: start would proceed", dry.proceed)
    ctx.expect("dry run: stale shm 'would remove'", _shm_status(dry, stale) == "would remove")
    ctx.expect("dry run: held shm 'keep'", _shm_status(dry, held) == "keep")
    ctx.expect("orphans still alive after dry run", all(live(w) for w in workers))

    # Real run, watched.
    watch = workers + list(decoys.values())
    baseline = [r.get("v2_used_mib", 0) for r in ctx.result["facts"]["idle"]]
    mon = Monitor(ctx.gpus, watch)
    mon.start()
    time.sleep(0.05)
    table = TimingTable()
    t_start = time.monotonic()
    error = None
    try:
        real = Preflight(cfg, ctx.probe, table, SystemClock(), log).run(dry_run=False)
    except Exception as exc:
        real, error = None, f"{type(exc).__name__}: {exc}"
    t_end = time.monotonic()
    time.sleep(0.5)  # let the monitor see reaping finish
    mon.stop()
    res["real_run_s"] = round(t_end - t_start, 4)
    res["real_run_error"] = error
    if real is not None:
        text = render_text(real, "gpu-tier")
        res["real_run_report"] = text.splitlines()
        res["real_run"] = real.to_dict()
        print(text, flush=True)
    ctx.expect("real preflight passed", real is not None and real.proceed, error or "")
    signalled = sorted({pid for _, pid, _ in table.sent})
    res["signals"] = [{"t_ms": round((t - t_start) * 1000, 2), "pid": p, "sig": s} for t, p, s in table.sent]
    ctx.expect("signals went to exactly the orphans", signalled == sorted(workers), f"signalled={signalled}")
    ctx.expect("no SIGKILL was needed", not any(s == "SIGKILL" for _, _, s in table.sent))
    ctx.expect("orphans are gone", not any(live(w) for w in workers))
    ctx.expect(
        "decoys alive", all(live(p) for p in decoys.values()), str({k: proc_state(v) for k, v in decoys.items()})
    )
    ctx.expect("stale shm file removed", not stale.exists())
    ctx.expect("held shm file kept", held.exists())
    left = sorted(set(_shm_listing(ctx.shm_dir)) - shm_before - {"psm_test_held"})
    res["shm_left_after"] = left
    ctx.expect("no NCCL/psm shm file left behind", not left, f"left={left}")
    used_after = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_after"] = used_after
    ctx.expect("memory returned on every GPU", all(u <= THRESHOLD_MIB for u in used_after), f"used={used_after}")

    # Timeline per GPU.
    term = {pid: t for t, pid, s in table.sent if s == "SIGTERM"}
    per_gpu = []
    for r, w in enumerate(workers):
        ts = term.get(w)
        row: dict[str, Any] = {"gpu": r, "pid": w}
        if ts is not None:
            mem_thr = mon.first_mem_at_or_below(r, THRESHOLD_MIB, ts)
            mem_base = mon.first_mem_at_or_below(r, baseline[r] + 64, ts)
            # The monitor stamps a sample before reading /proc, and the SIGTERM
            # stamp comes before os.kill: allow 10 ms of skew between the two.
            t_z = mon.first_state(w, "ZX-", ts - 0.01)
            t_zombie = mon.first_state(w, "Z", ts - 0.01)
            t_gone = mon.first_state(w, "-", ts - 0.01)
            t_nv = mon.nvml_pid_gone(r, w, ts)
            row.update(
                sigterm_after_start_ms=_ms(ts - t_start),
                memory_below_threshold_ms=_ms(mem_thr - ts if mem_thr else None),
                memory_at_baseline_ms=_ms(mem_base - ts if mem_base else None),
                nvml_pid_gone_ms=_ms(t_nv - ts if t_nv else None),
                exited_ms=_ms(t_z - ts if t_z else None),
                zombie_seen=t_zombie is not None,
                reaped_ms=_ms(t_gone - ts if t_gone else None),
                zombie_for_ms=_ms(t_gone - t_zombie if (t_gone and t_zombie) else None),
                states=[(_ms(t - ts), s) for t, s in mon.states.get(w, [])],
            )
        per_gpu.append(row)
    res["per_gpu"] = per_gpu
    res["monitor_samples"] = len(mon.mem)
    res["monitor_errors"] = mon.errors
    for row in per_gpu:
        print(f"  GPU {row['gpu']}: {json.dumps({k: v for k, v in row.items() if k != 'states'})}", flush=True)
    ctx.result["orphans_ctx"] = {"decoys": decoys, "held": str(held)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _shm_status(report: Any, path: Path) -> str | None:
    for c in report.checks:
        if c.name == "shm" and c.data.get("path") == str(path):
            return str(c.status.value)
    return None


def _nccl_transport(ctx: Ctx) -> list[str]:
    lines = []
    for f in sorted(ctx.state.glob("nccl.*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if " via " in line or "NCCL version" in line:
                lines.append(line.strip()[:200])
    return lines[:20]


def step_holder(ctx: Ctx) -> None:
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.exitcodes import PreflightError
    from kimi_supervisor.journal import get_logger
    from kimi_supervisor.preflight import Preflight
    from kimi_supervisor.report import render_text

    print("\n== b(ii). a GPU holder that matches no kill rule ==", flush=True)
    res: dict[str, Any] = {}
    ctx.result["holder"] = res
    cmd = [sys.executable, str(HERE), "_holder", "--gpu", "0", "--mib", str(ctx.mib)]
    cmd += ["--ready", str(ctx.state / "holder.ready")]
    if ctx.fake_dir:
        cmd += ["--fake-dir", ctx.fake_dir]
    holder = ctx.spawn(cmd, "holder.log")
    wait_file(ctx.state / "holder.ready", 90, [holder])
    used = ctx.gpus.used_mib(0)
    res["holder_pid"] = holder.pid
    res["used_mib_gpu0"] = used
    cfg = make_config(ctx, deadline_s=5.0)
    log = get_logger()
    table = TimingTable()
    dry = Preflight(cfg, ctx.probe, table, SystemClock(), log).run(dry_run=True)
    res["dry_run_report"] = render_text(dry, "gpu-tier").splitlines()
    print("\n".join(res["dry_run_report"]), flush=True)
    ctx.expect("holder dry run: would not proceed (would wait)", not dry.proceed)
    t = time.monotonic()
    err = None
    try:
        Preflight(cfg, ctx.probe, table, SystemClock(), log).run(dry_run=False)
    except PreflightError as exc:
        err = exc
    res["real_run_s"] = round(time.monotonic() - t, 3)
    res["error"] = err.message if err else None
    res["exit_code"] = int(err.exit_code) if err else None
    print(f"  PreflightError after {res['real_run_s']}s: {res['error']}", flush=True)
    ctx.expect("preflight raised PreflightError", err is not None)
    msg = err.message if err else ""
    ctx.expect(
        "message names GPU 0, its MiB and the holder PID",
        "GPU 0" in msg and f"PID {holder.pid}" in msg and "MiB" in msg,
    )
    ctx.expect("message says why it was spared", "does not match" in msg)
    ctx.expect("preflight waited ~deadline (5 s)", 4.5 <= res["real_run_s"] <= 9.0, f"{res['real_run_s']}s")
    ctx.expect("nothing was signalled", not table.sent, str(table.sent))
    ctx.expect("holder still alive", live(holder.pid))
    decoys = ctx.result.get("orphans_ctx", {}).get("decoys", {})
    ctx.expect("decoys still alive", all(live(p) for p in decoys.values()))
    # Our own holder: end it and wait for its memory.
    t = time.monotonic()
    holder.terminate()
    holder.wait(30)
    while ctx.gpus.used_mib(0) > THRESHOLD_MIB and time.monotonic() - t < 30:
        time.sleep(0.01)
    res["holder_memory_back_after_sigterm_s"] = round(time.monotonic() - t, 3)


# -- c: the supervisor's stop ---------------------------------------------------------


def step_supervisor(ctx: Ctx) -> None:
    print("\n== c. supervisor: ready, SIGTERM, tree gone, GPUs free ==", flush=True)
    import psutil

    res: dict[str, Any] = {}
    ctx.result["supervisor"] = res
    port = _free_port()
    argv = [
        "python3",
        str(REPO / "bench" / "gpu_child.py"),
        "serve",
        "/tmp/x",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--tensor-parallel-size",
        str(ctx.ngpu),
    ]
    env = {**SAFE_ENV, "GPU_CHILD_MIB": str(ctx.mib), "GPU_CHILD_RUNDIR": str(ctx.state / "child")}
    env.update({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0"})
    if ctx.fake_dir:
        env.update(GPU_CHILD_FAKE="1", GPU_CHILD_FAKE_DIR=ctx.fake_dir)
    toml = [
        "[child]",
        "argv = [" + ", ".join(json.dumps(a) for a in argv) + "]",
        "[child.env]",
        *(f"{k} = {json.dumps(v)}" for k, v in env.items()),
        "[preflight]",
        "check_model = false",
        "deadline_s = 30",
        # Fake mode: the CLI's own NvmlProbe has no GPU to see.
        *(["gpus = []"] if ctx.fake else []),
        "[preflight.shm]",
        f"directory = {json.dumps(ctx.shm_dir)}",
        "[readiness]",
        "deadline_s = 240",
        "stall_timeout_s = 200",
        "[shutdown]",
        "grace_s = 30",
        "gpu_release_timeout_s = 30",
    ]
    cfg_path = ctx.state / "supervisor.toml"
    cfg_path.write_text("\n".join(toml) + "\n")
    os.chmod(cfg_path, 0o600)
    res["config"] = cfg_path.read_text().splitlines()
    cmd = [sys.executable, "-m", "kimi_supervisor", "--config", str(cfg_path), "--log-format", "json"]
    res["command"] = " ".join(cmd)
    senv = _child_env()
    senv["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH", ""), str(REPO)]))
    t0 = time.monotonic()
    sup = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=senv, cwd=REPO, start_new_session=True
    )
    ctx.started.append(sup)
    events: list[tuple[float, dict[str, Any]]] = []
    child_lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def reader(stream: Any, is_events: bool) -> None:
        for raw in iter(stream.readline, b""):
            t = time.monotonic()
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                obj = json.loads(line)
            except ValueError:
                obj = {"raw": line}
            with lock:
                if is_events:
                    events.append((t, obj))
                else:
                    child_lines.append((t, line))

    threads = [
        threading.Thread(target=reader, args=(sup.stderr, True), daemon=True),
        threading.Thread(target=reader, args=(sup.stdout, False), daemon=True),
    ]
    for th in threads:
        th.start()

    def event(name: str) -> tuple[float, dict[str, Any]] | None:
        with lock:
            for t, e in events:
                if e.get("event") == name:
                    return t, e
        return None

    deadline = time.monotonic() + 150
    while event("state.ready") is None and sup.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ready = event("state.ready")
    res["ready_after_s"] = round(ready[0] - t0, 3) if ready else None
    ok = ctx.expect("supervisor reached state.ready", ready is not None, f"after {res['ready_after_s']}s")
    if not ok:
        with lock:
            res["events"] = [e for _, e in events][-40:]
            res["child_lines"] = [line for _, line in child_lines][-40:]
        print("\n".join(json.dumps(e) for e in res["events"]), flush=True)
        if sup.poll() is None:
            sup.terminate()
            sup.wait(60)
        return
    time.sleep(1.0)  # a few health probes while serving
    tree = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
    res["tree_pids"] = tree
    res["tree"] = {str(p): _comm(p) for p in tree}
    used = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_serving"] = used
    print(f"  ready after {res['ready_after_s']}s; tree {res['tree']}; used MiB {used}", flush=True)
    mon = Monitor(ctx.gpus, [*tree, sup.pid], with_nvml_pids=False)
    mon.start()
    time.sleep(0.05)
    t_term = time.monotonic()
    sup.send_signal(signal.SIGTERM)
    rc = sup.wait(120)
    t_exit = time.monotonic()
    time.sleep(0.3)
    mon.stop()
    for th in threads:
        th.join(5)
    res["exit_code"] = rc
    res["exit_after_s"] = round(t_exit - t_term, 3)
    dead_at = [mon.first_state(p, "ZX-", t_term) for p in tree]
    gone_at = [mon.first_state(p, "-", t_term) for p in tree]
    res["all_descendants_dead_s"] = round(max(dead_at) - t_term, 3) if all(dead_at) else None
    res["all_descendants_reaped_s"] = round(max(gone_at) - t_term, 3) if all(gone_at) else None
    mem_at = [mon.first_mem_at_or_below(i, THRESHOLD_MIB, t_term) for i in range(ctx.ngpu)]
    res["gpu_memory_back_s"] = [round(t - t_term, 3) if t else None for t in mem_at]
    for name in (
        "signal.received",
        "stop.sigterm",
        "stop.sigkill",
        "stop.tree_gone",
        "stop.tree_left",
        "stop.gpu_released",
        "stop.gpu_still_busy",
        "state.stopped",
        "state.failed",
    ):
        ev = event(name)
        if ev:
            res.setdefault("events_after_sigterm", {})[name] = {"at_s": round(ev[0] - t_term, 3), **ev[1]}
    with lock:
        res["event_names"] = [e.get("event") for _, e in events]
        res["child_lines_tail"] = [line for _, line in child_lines][-12:]
    print(f"  exit code {rc} after {res['exit_after_s']}s", flush=True)
    for k, v in res.get("events_after_sigterm", {}).items():
        print(f"    {k}: {json.dumps(v)}", flush=True)
    print(
        f"  descendants dead {res['all_descendants_dead_s']}s, reaped {res['all_descendants_reaped_s']}s; "
        f"GPU memory back {res['gpu_memory_back_s']}",
        flush=True,
    )
    ctx.expect("exit code 0", rc == 0, str(rc))
    ctx.expect(
        "supervisor logged stop.gpu_released", "stop.gpu_released" in res.get("events_after_sigterm", {}) or ctx.fake
    )
    ctx.expect("no SIGKILL was needed", "stop.sigkill" not in res.get("events_after_sigterm", {}))
    ctx.expect("every descendant is gone", not any(os.path.exists(f"/proc/{p}") for p in tree))
    strays = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any("gpu_child.py" in a for a in (p.info["cmdline"] or [])):
                strays.append(p.pid)
    res["strays"] = strays
    res["shm_after_stop"] = _shm_listing(ctx.shm_dir)
    ctx.expect("no gpu_child.py process remains", not strays, str(strays))
    used = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_after"] = used
    ctx.expect("GPUs free after stop", all(u <= THRESHOLD_MIB for u in used), f"{used}")


# -- d: benchmark ------------------------------------------------------------------------


SEED_LOOP_SUM = (
    "for i in $(seq 1 30); do free=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits "
    "| awk '{s+=$1} END {print s}'); [ \"$free\" -lt 1000 ] && exit 0; sleep 1; done; exit 1"
)
SEED_LOOP_MAX = (
    "for i in $(seq 1 30); do used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits "
    "| awk 'BEGIN {m=0} {if ($1>m) m=$1} END {print m}'); [ \"$used\" -lt 1000 ] && exit 0; sleep 1; done; exit 1"
)


def step_bench(ctx: Ctx) -> None:
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.gpu import NvmlProbe
    from kimi_supervisor.preflight import Preflight
    from kimi_supervisor.proctable import PsutilProcessTable

    print("\n== d. benchmark on clean GPUs ==", flush=True)
    res: dict[str, Any] = {"reps": ctx.reps}
    ctx.result["bench"] = res
    import structlog

    quiet = structlog.get_logger()  # events still go through the chain; level info is fine
    cfg = make_config(ctx)
    table = PsutilProcessTable()

    def once(probe: Any) -> float:
        t = time.perf_counter()
        rep = Preflight(cfg, probe, table, SystemClock(), quiet).run(dry_run=False)
        dt = time.perf_counter() - t
        assert rep.proceed
        return dt

    warm_probe = ctx.probe if ctx.fake else NvmlProbe()
    once(warm_probe)
    warm = [once(warm_probe) for _ in range(ctx.reps)]
    res["preflight_warm_s"] = summary(warm)
    res["preflight_config"] = (
        "Preflight.run(dry_run=False), gpus=all, tp=N, check_port, shm on (/dev/shm), threshold 1000 MiB, "
        "reap on, no model check; one NvmlProbe reused (as the supervisor does)"
    )
    # End to end, as an ExecStartPre would pay it: a new process, imports, nvmlInit, preflight.
    cfg_path = ctx.state / "bench.toml"
    cfg_path.write_text(
        '[child]\nargv = ["vllm", "serve", "/tmp/x", "--port", "%d", "--tensor-parallel-size", "%d"]\n'
        "[preflight]\ncheck_model = false\ngpus = %s\n%s"
        % (
            _free_port(),
            ctx.ngpu,
            json.dumps(list(range(ctx.ngpu))) if not ctx.fake else "[]",
            f"[preflight.shm]\ndirectory = {json.dumps(ctx.shm_dir)}\n",
        )
    )
    os.chmod(cfg_path, 0o600)
    cenv = _child_env()
    cenv["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH", ""), str(REPO)]))
    cli, cli_codes = [], []
    for _ in range(max(5, ctx.reps // 2)):
        t = time.perf_counter()
        cp = subprocess.run(
            [sys.executable, "-m", "kimi_supervisor", "--dry-run", "--config", str(cfg_path), "--log-format", "json"],
            env=cenv,
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
        )
        cli.append(time.perf_counter() - t)
        cli_codes.append(cp.returncode)
    res["cli_dry_run_s"] = summary(cli)
    res["cli_dry_run_exit_codes"] = sorted(set(cli_codes))
    res["cli_dry_run_output"] = cp.stdout.splitlines()[-12:]
    if not ctx.fake:
        inits = []
        code = "import time,pynvml;t=time.perf_counter();pynvml.nvmlInit();print(time.perf_counter()-t)"
        for _ in range(5):
            cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
            with contextlib.suppress(ValueError):
                inits.append(float(cp.stdout.strip()))
        res["nvml_init_fresh_process_s"] = summary(inits)

    benv = _child_env()
    if ctx.fake:
        fakebin = ctx.state / "fakebin"
        fakebin.mkdir(exist_ok=True)
        smi = fakebin / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join("echo 0\n" for _ in range(ctx.ngpu)))
        smi.chmod(0o755)
        benv["PATH"] = f"{fakebin}:{benv['PATH']}"
    for key, script in (("seed_loop_sum", SEED_LOOP_SUM), ("seed_loop_max", SEED_LOOP_MAX)):
        times, codes = [], []
        for _ in range(ctx.reps):
            t = time.perf_counter()
            rc = subprocess.run(["bash", "-c", script], env=benv, check=False).returncode
            times.append(time.perf_counter() - t)
            codes.append(rc)
        res[key] = {"script": script, "s": summary(times), "exit_codes": sorted(set(codes))}
    smi_times = []
    smi_out = ""
    for _ in range(max(10, ctx.reps // 2)):
        t = time.perf_counter()
        cp = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            env=benv,
            capture_output=True,
            text=True,
            check=False,
        )
        smi_times.append(time.perf_counter() - t)
        smi_out = cp.stdout.strip()
    res["nvidia_smi_query_s"] = summary(smi_times)
    res["nvidia_smi_output"] = smi_out.splitlines()

    if not ctx.fake:
        nv = ctx.gpus.nv
        h = ctx.gpus.handles[0]
        lat: dict[str, Any] = {}
        for label, fn in (
            ("memory_info_v1", lambda: nv.nvmlDeviceGetMemoryInfo(h)),
            ("memory_info_v2", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)),
            ("compute_running_processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)),
            ("probe_memory (NvmlProbe.memory)", lambda: warm_probe.memory(0)),
            ("probe_processes (NvmlProbe.processes)", lambda: warm_probe.processes(0)),
        ):
            for _ in range(20):
                fn()
            samples = []
            for _ in range(2000 if "processes" not in label else 500):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e6)
            lat[label] = {k: round(v, 2) for k, v in summary(samples).items()}
        res["nvml_latency_us"] = lat
        warm_probe.close()

    pw = res["preflight_warm_s"]["median"]
    rows = [
        ("preflight (warm NvmlProbe)", res["preflight_warm_s"]),
        ("kimi-supervisor --dry-run (new process, end to end)", res["cli_dry_run_s"]),
        ("seed bash loop (sum)", res["seed_loop_sum"]["s"]),
        ("seed bash loop (per-GPU max)", res["seed_loop_max"]["s"]),
        ("nvidia-smi --query-gpu=memory.used", res["nvidia_smi_query_s"]),
    ]
    res["table"] = [
        {"what": w, "median_ms": s["median"] * 1000, "p95_ms": s["p95"] * 1000, "x_warm_preflight": s["median"] / pw}
        for w, s in rows
    ]
    print(f"  {'what':<40} {'median ms':>10} {'p95 ms':>10} {'x preflight':>12}")
    for r in res["table"]:
        print(f"  {r['what']:<40} {r['median_ms']:>10.2f} {r['p95_ms']:>10.2f} {r['x_warm_preflight']:>12.2f}")
    if "nvml_latency_us" in res:
        for k, v in res["nvml_latency_us"].items():
            print(f"  NVML {k}: {v}")


# -- cleanup and output -------------------------------------------------------------------


def end_decoys(ctx: Ctx) -> None:
    """The decoys (ours) have done their job; the benchmark wants a clean host."""
    decoys = ctx.result.get("orphans_ctx", {}).get("decoys", {})
    if decoys:
        ctx.expect("decoys alive after every scenario", all(live(p) for p in decoys.values()))
    for p in ctx.started:
        if p.pid in decoys.values() and p.poll() is None:
            p.kill()
            p.wait(10)
    for name in ("psm_test_held", "psm_test_stale"):
        with contextlib.suppress(OSError):
            (Path(ctx.shm_dir) / name).unlink()
    ctx.result["shm_before_bench"] = _shm_listing(ctx.shm_dir)


def cleanup(ctx: Ctx) -> None:
    for p in ctx.started:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL) if _own_group(p.pid) else p.kill()
    for p in ctx.started:
        with contextlib.suppress(Exception):
            p.wait(10)
    # Orphaned workers this script started (their parent is gone): recorded PIDs only.
    for w in ctx.result.get("orphans", {}).get("workers", []):
        pid = int(w["pid"])
        if live(pid) and _comm(pid) == "VLLM::Worker_TP":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for name in ("psm_test_held", "psm_test_stale"):
        with contextlib.suppress(OSError):
            (Path(ctx.shm_dir) / name).unlink()
    ctx.result["swept_at_exit"] = sweep_marked()


def sweep_marked() -> list[int]:
    """SIGKILL every process that carries this run's marker in its environment (all ours)."""
    marker = f"GPU_TIER_RUN_ID={os.environ.get('GPU_TIER_RUN_ID', '')}".encode()
    if marker.endswith(b"="):
        return []
    killed = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if marker in env and live(int(name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
    return killed


def _own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def write_outputs(ctx: Ctx) -> None:
    ctx.result["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in ctx.checks]
    ctx.result["all_ok"] = all(ok for _, ok, _ in ctx.checks)
    if ctx.log_tee is not None:
        ctx.result["supervisor_log_lines"] = ctx.log_tee.lines[-200:]
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "gpu_tier.json").write_text(json.dumps(ctx.result, indent=2, default=str) + "\n")
    (ctx.out / "gpu_tier.md").write_text(render_md(ctx.result))
    print(f"\nwrote {ctx.out / 'gpu_tier.json'} and {ctx.out / 'gpu_tier.md'}", flush=True)


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render_md(r: dict[str, Any]) -> str:
    m = r.get("meta", {})
    out = [
        "# kimi-supervisor GPU tier",
        "",
        f"- host: {m.get('host')}; GPUs: {m.get('ngpu')}; driver {m.get('driver')}; NVML {m.get('nvml')}; "
        f"torch {m.get('torch')}; nvidia-ml-py {m.get('nvidia_ml_py')}; psutil {m.get('psutil')}; "
        f"python {m.get('python')}; fake={m.get('fake')}",
        f"- started {m.get('started')}; took {m.get('wall_s')} s; env {json.dumps(m.get('safe_env'))}",
        f"- all checks passed: **{r.get('all_ok')}**",
        "",
        "## Expectations",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    for c in r.get("checks", []):
        out.append(f"| {c['name']} | {'PASS' if c['ok'] else '**FAIL**'} | {str(c['detail']).replace('|', '/')} |")
    out += [
        "",
        f"- processes of this run still alive at exit and SIGKILLed by the final sweep: {r.get('swept_at_exit')}",
    ]
    if r.get("errors"):
        out += ["", "## Errors", "", "```", *r["errors"], "```"]
    f = r.get("facts", {})
    if f:
        out += [
            "",
            "## a. NVML facts",
            "",
            "| GPU | when | v1 used | v2 used | v2 reserved | total | processes |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for when in ("idle", "loaded"):
            for row in f.get(when, []):
                procs = (
                    ", ".join(
                        f"{p.get('kind', '')} PID {p.get('pid')} {p.get('used_mib')} MiB "
                        f"({'in /proc' if p.get('in_proc', True) else 'NOT in /proc'}, {p.get('comm')})"
                        for p in row.get("procs", [])
                        if "pid" in p
                    )
                    or "none"
                )
                out.append(
                    f"| {row['gpu']} | {when} | {_f(row.get('v1_used_mib'))} | {_f(row.get('v2_used_mib'))} | "
                    f"{_f(row.get('v2_reserved_mib'))} | {_f(row.get('v2_total_mib', row.get('v1_total_mib')))} | "
                    f"{procs} |"
                )
    o = r.get("orphans", {})
    if o:
        out += ["", "## b. Orphans + decoys", ""]
        out.append(
            f"- tree up in {o.get('tree_start_s')} s; workers: "
            + "; ".join(
                f"PID {w['pid']} GPU {w['gpu']} {json.dumps({k: v for k, v in w.items() if k not in ('pid', 'gpu', 'shm_after_init')})}"
                for w in o.get("workers", [])
            )
        )
        out.append(
            "- names (psutil name() / comm / cmdline): "
            + "; ".join(
                f"{pid} {n['role']}: {n['psutil_name']!r} / {n['comm']!r} / {' '.join(n['cmdline'])[:80]!r}"
                for pid, n in o.get("names", {}).items()
            )
        )
        out.append(
            f"- /dev/shm files new while the tree ran: {o.get('shm_new_with_tree')}; seen by workers right "
            f"after NCCL init: {o.get('shm_seen_by_workers')}; after orphaning: {o.get('shm_after_orphaning')}"
        )
        out.append(
            f"- orphans' ppid after the parent's SIGKILL: {o.get('orphan_ppids')}; "
            f"used MiB while orphaned: {o.get('used_mib_orphaned')}"
        )
        out.append(
            f"- dry run {o.get('dry_run_s')} s; real run {o.get('real_run_s')} s (total preflight wall time)"
            f"{'; error: ' + o['real_run_error'] if o.get('real_run_error') else ''}"
        )
        out += [
            "",
            "Dry run report:",
            "",
            "```",
            *o.get("dry_run_report", []),
            "```",
            "",
            "Real run report:",
            "",
            "```",
            *o.get("real_run_report", []),
            "```",
            "",
        ]
        out += [
            "Signals (ms after the real run began): "
            + ", ".join(f"{s['sig']}→{s['pid']} @{s['t_ms']}" for s in o.get("signals", [])),
            "",
        ]
        out += [
            "| GPU | PID | SIGTERM→memory ≤1000 MiB (ms) | →baseline (ms) | →NVML stops listing PID (ms) | "
            "→exited (Z or gone) (ms) | zombie seen | →reaped (ms) | zombie for (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for g in o.get("per_gpu", []):
            out.append(
                f"| {g['gpu']} | {g['pid']} | {_f(g.get('memory_below_threshold_ms'))} | "
                f"{_f(g.get('memory_at_baseline_ms'))} | {_f(g.get('nvml_pid_gone_ms'))} | "
                f"{_f(g.get('exited_ms'))} | {g.get('zombie_seen')} | {_f(g.get('reaped_ms'))} | "
                f"{_f(g.get('zombie_for_ms'))} |"
            )
        out += [
            "",
            "State timelines (ms after SIGTERM, /proc state letter, '-' = reaped): "
            + "; ".join(f"PID {g['pid']}: {g.get('states')}" for g in o.get("per_gpu", [])),
        ]
    h = r.get("holder", {})
    if h:
        out += [
            "",
            "## b(ii). Non-matching GPU holder",
            "",
            f"- holder PID {h.get('holder_pid')} (comm 'trainer'), GPU 0 used {h.get('used_mib_gpu0')} MiB",
            f"- real preflight (deadline 5 s) raised after {h.get('real_run_s')} s, exit code "
            f"{h.get('exit_code')}: `{h.get('error')}`",
            f"- holder's own memory back {h.get('holder_memory_back_after_sigterm_s')} s after its SIGTERM",
            "",
            "Dry run:",
            "",
            "```",
            *h.get("dry_run_report", []),
            "```",
        ]
    s = r.get("supervisor", {})
    if s:
        out += [
            "",
            "## c. Supervisor stop",
            "",
            f"- `{s.get('command')}`",
            f"- ready (state.ready) {s.get('ready_after_s')} s after launch; tree {s.get('tree')}; "
            f"used MiB while serving {s.get('used_mib_serving')}",
            f"- SIGTERM → exit {s.get('exit_after_s')} s, exit code {s.get('exit_code')}",
            f"- every descendant dead (Z or gone) {s.get('all_descendants_dead_s')} s, reaped "
            f"{s.get('all_descendants_reaped_s')} s; GPU memory ≤1000 MiB per GPU (s): {s.get('gpu_memory_back_s')}",
            f"- strays: {s.get('strays')}; used MiB after: {s.get('used_mib_after')}",
            "",
            "| event | s after SIGTERM | fields |",
            "| --- | --- | --- |",
        ]
        for k, v in s.get("events_after_sigterm", {}).items():
            fields = {a: b for a, b in v.items() if a not in ("at_s", "event", "timestamp", "level")}
            out.append(f"| {k} | {v.get('at_s')} | {json.dumps(fields)[:200]} |")
        out += ["", "Config:", "", "```toml", *s.get("config", []), "```"]
    b = r.get("bench", {})
    if b.get("table"):
        out += [
            "",
            f"## d. Benchmark on clean GPUs ({b.get('reps')} reps each)",
            "",
            "| what | median ms | p95 ms | × warm preflight median |",
            "| --- | --- | --- | --- |",
        ]
        for row in b["table"]:
            out.append(
                f"| {row['what']} | {row['median_ms']:.2f} | {row['p95_ms']:.2f} | {row['x_warm_preflight']:.2f} |"
            )
        out += [
            "",
            f"- preflight config: {b.get('preflight_config')}",
            f"- seed loop (sum) as run: `bash -c '{b['seed_loop_sum']['script']}'` exit codes "
            f"{b['seed_loop_sum']['exit_codes']}",
            f"- seed loop (per-GPU max) as run: `bash -c '{b['seed_loop_max']['script']}'` exit codes "
            f"{b['seed_loop_max']['exit_codes']}",
            f"- nvidia-smi output: {b.get('nvidia_smi_output')}",
        ]
        if b.get("nvml_latency_us"):
            out += ["", "| NVML call (GPU 0) | median µs | p95 µs | mean µs |", "| --- | --- | --- | --- |"]
            for k, v in b["nvml_latency_us"].items():
                if isinstance(v, dict):
                    out.append(f"| {k} | {v['median']} | {v['p95']} | {v['mean']} |")
                else:
                    out.append(f"| {k} | {v} (ms) | | |")
    return "\n".join(out) + "\n"


def main_bench(a: argparse.Namespace) -> int:
    from kimi_supervisor.journal import configure

    t0 = time.monotonic()
    # Marks every process this run starts (they inherit it): the final sweep ends them all.
    os.environ["GPU_TIER_RUN_ID"] = f"{os.getpid()}-{time.time_ns()}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="gpu_tier."))
    fake_dir = str(state / "fakegpu") if a.fake else None
    if a.fake:
        shm_dir = str(state / "shm")
        os.makedirs(shm_dir)
        probe: Any = FakeProbe(fake_dir, a.fake_gpus)  # type: ignore[arg-type]
    else:
        from kimi_supervisor.gpu import NvmlProbe

        shm_dir = "/dev/shm"
        probe = NvmlProbe()
    # NCCL's own log, to see the transport it chose.
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
    os.environ.setdefault("NCCL_DEBUG_FILE", str(state / "nccl.%h.%p.log"))
    gpus = Gpus(probe if a.fake else None)
    ngpu = gpus.count if a.gpus is None else a.gpus
    tee = Tee()
    configure("console", "info", stream=tee)  # type: ignore[arg-type]
    ctx = Ctx(out, a.fake, a.mib, a.reps, ngpu, gpus, probe, shm_dir, state, fake_dir, log_tee=tee)
    torch_v = None
    if not a.fake:
        with contextlib.suppress(Exception):
            torch_v = subprocess.run(
                [sys.executable, "-c", "import torch;print(torch.__version__, torch.cuda.device_count())"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            ).stdout.strip()
    ctx.result["meta"] = {
        "host": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "ngpu": ngpu,
        "fake": a.fake,
        "mib_per_worker": a.mib,
        "torch": torch_v,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "safe_env": {k: os.environ.get(k) for k in SAFE_ENV},
        "nccl_env": {k: v for k, v in _child_env().items() if k.startswith("NCCL_")},
        "command": os.environ.get("GPU_TIER_COMMAND"),
    }
    errors: list[str] = []
    ctx.result["errors"] = errors

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}: writing partial results")

    signal.signal(signal.SIGTERM, on_term)
    steps = [step_facts_idle, step_orphans, step_holder, step_supervisor, step_bench]
    only = set(a.only.split(",")) if a.only else None
    try:
        for step in steps:
            if only and step.__name__.removeprefix("step_") not in only:
                continue
            try:
                step(ctx)
            except Exception:
                tb = traceback.format_exc()
                errors.append(f"{step.__name__}: {tb}")
                ctx.expect(f"{step.__name__} ran without error", False, tb.strip().splitlines()[-1])
                print(tb, file=sys.stderr, flush=True)
            if step is step_supervisor:
                end_decoys(ctx)
    except KeyboardInterrupt as exc:
        errors.append(f"interrupted: {exc}")
        ctx.expect("run finished before its time limit", False, str(exc))
    finally:
        ctx.result["meta"]["wall_s"] = round(time.monotonic() - t0, 1)
        cleanup(ctx)
        # Copy worker/NCCL logs' heads for the record.
        logs = {}
        for f in sorted(state.glob("*.log")):
            logs[f.name] = f.read_text(errors="replace").splitlines()[-15:]
        ctx.result["logs"] = logs
        write_outputs(ctx)
        gpus.close()
        probe.close()
        if not a.keep_state:
            shutil.rmtree(state, ignore_errors=True)
    print("\n== summary ==")
    for n, ok, d in ctx.checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {n}{': ' + d if d else ''}")
    return 0 if ctx.result.get("all_ok") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("_worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--gpu", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--mib", type=int, required=True)
    w.add_argument("--master-port", type=int, required=True)
    w.add_argument("--ready", required=True)
    w.add_argument("--name", required=True)
    w.add_argument("--shm-dir", required=True)
    w.add_argument("--fake-dir")
    pa = sub.add_parser("_parent")
    pa.add_argument("--world", type=int, required=True)
    pa.add_argument("--mib", type=int, required=True)
    pa.add_argument("--state", required=True)
    pa.add_argument("--shm-dir", required=True)
    pa.add_argument("--fake-dir")
    d = sub.add_parser("_decoy_ctl")
    d.add_argument("--ready", required=True)
    d.add_argument("--hold", required=True)
    d.add_argument("--dev", action="append", default=[])
    h = sub.add_parser("_holder")
    h.add_argument("--gpu", type=int, required=True)
    h.add_argument("--mib", type=int, required=True)
    h.add_argument("--ready", required=True)
    h.add_argument("--fake-dir")
    p.add_argument("--out", help="output folder for gpu_tier.json and gpu_tier.md")
    p.add_argument("--mib", type=int, default=4096, help="MiB each worker holds (default 4096)")
    p.add_argument("--reps", type=int, default=20, help="benchmark repetitions (default 20)")
    p.add_argument("--gpus", type=int, default=None, help="use the first N GPUs (default: all)")
    p.add_argument("--fake", action="store_true", help="no GPU: fake probe, CPU-only workers")
    p.add_argument("--fake-gpus", type=int, default=2)
    p.add_argument("--only", help="comma list of steps: facts_idle,orphans,holder,supervisor,bench")
    p.add_argument("--keep-state", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "_worker":
        return sub_worker(a)
    if a.cmd == "_parent":
        return sub_parent(a)
    if a.cmd == "_decoy_ctl":
        return sub_decoy_ctl(a)
    if a.cmd == "_holder":
        return sub_holder(a)
    if not a.out:
        p.error("--out DIR is required")
    sys.path.insert(0, str(REPO))
    return main_bench(a)


if __name__ == "__main__":
    sys.exit(main())
