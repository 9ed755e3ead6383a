#!/usr/bin/env python3
"""A stand-in for `vllm serve` with tensor parallelism, holding real GPU memory.

    python3 gpuaccept/gpu_child.py serve MODEL --port P --host H --tensor-parallel-size N

The main process ("APIServer") spawns N workers (comm `VLLM::Worker_TP<i>`, as
vLLM's setproctitle names them), one per GPU.  Each worker allocates
GPU_CHILD_MIB MiB (default 4096) on its GPU with torch; with N >= 2 they form a
torch.distributed NCCL group and run one all_reduce.  Once every worker is
ready the main process prints vLLM-shaped lines and serves GET /health (200)
on HOST:PORT with the stdlib http.server.  SIGTERM/SIGINT: terminate the
workers, wait for them, exit 0 (as vLLM's API server does).

GPU_CHILD_FAKE=1: no torch and no GPU (CPU logic tests); the worker registers
its allocation in GPU_CHILD_FAKE_DIR/gpu<i>/<pid> for the bench's fake probe.
Stdlib only in the main process; torch only in workers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Run as a script: the repository is the import root (for the shared process helpers).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Importing gpu_tier/common.py sets its SAFE_ENV (NVLink multicast off, mandatory on the multi-GPU machines).
from gpuaccept.gpu_tier.common import SAFE_ENV, hold_gpu_memory, nccl_all_reduce, write_json
from testkit.procutil import free_port, set_comm


def stamp() -> str:
    return time.strftime("%m-%d %H:%M:%S")


def say(who: str, msg: str, where: str = "gpu_child.py:1") -> None:
    sys.stdout.write(f"({who} pid={os.getpid()}) INFO {stamp()} [{where}] {msg}\n")
    sys.stdout.flush()


# -- worker ------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    set_comm(f"VLLM::Worker_TP{args.rank}")
    who = f"Worker_TP{args.rank}"
    fake = os.environ.get("GPU_CHILD_FAKE") == "1"
    say(who, f"worker starting on GPU {args.rank} (world size {args.world})")
    info = {"pid": os.getpid(), "rank": args.rank}
    hold = hold_gpu_memory(args.rank, args.mib, os.environ["GPU_CHILD_FAKE_DIR"] if fake else None)
    if fake:
        time.sleep(0.3)
    else:
        import torch

        if args.world > 1:
            info.update(nccl_all_reduce(args.rank, args.rank, args.world, args.master_port))
        torch.cuda.synchronize()
        info["held_bytes"] = hold.numel()
        info.update(cuda_view())
    say(who, f"Loading weights took 0.01 GiB and 0.1 seconds; holding {args.mib} MiB ({json.dumps(info)})")
    write_json(args.ready, info)
    while True:
        time.sleep(3600)


def cuda_view() -> dict[str, object]:
    """What CUDA shows this worker (docs/configuration.md): its pinning variables, torch's device count, device 0's PCI
    bus id from torch and from the driver API (cuDeviceGetPCIBusId, which honours CUDA_DEVICE_ORDER)."""
    import ctypes

    import torch

    out: dict[str, object] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "nccl_ras_addr": os.environ.get("NCCL_RAS_ADDR"),
        "torch_device_count": torch.cuda.device_count(),
    }
    props = torch.cuda.get_device_properties(0)
    if hasattr(props, "pci_bus_id"):
        out["torch_pci_bus_id"] = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    with contextlib.suppress(OSError, AttributeError):
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, buf = ctypes.c_int(), ctypes.create_string_buffer(64)
        ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
        if ok and cuda.cuDeviceGetPCIBusId(buf, 64, dev) == 0:
            out["cuda_pci_bus_id"] = buf.value.decode()
    return out


# -- main (API server) ---------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    who = "APIServer"
    tp = args.tensor_parallel_size
    mib = int(os.environ.get("GPU_CHILD_MIB", "4096"))
    say(who, "vLLM API server version 0.11.0-gpu-child", "api_server.py:1839")
    say(who, f"non-default args: model={args.model!r}, tensor_parallel_size={tp}, port={args.port}")
    rundir = os.environ.get("GPU_CHILD_RUNDIR") or f"/tmp/gpu_child.{os.getpid()}"
    os.makedirs(rundir, exist_ok=True)
    master = free_port()
    workers: list[subprocess.Popen[bytes]] = []
    stopping = threading.Event()

    def on_stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    ready_files = []
    for rank in range(tp):
        ready = os.path.join(rundir, f"worker{rank}.ready")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        ready_files.append(ready)
        workers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "_worker",
                    "--rank",
                    str(rank),
                    "--world",
                    str(tp),
                    "--mib",
                    str(mib),
                    "--master-port",
                    str(master),
                    "--ready",
                    ready,
                ],
                env={**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"},
            )
        )
    say(who, f"Waiting for init message from {tp} worker(s)", "core.py:1")
    start = time.monotonic()
    while not all(os.path.exists(f) for f in ready_files):
        if stopping.is_set():
            return shutdown(workers, who)
        dead = [w for w in workers if w.poll() is not None]
        if dead:
            sys.stdout.write(
                f"RuntimeError: worker pid={dead[0].pid} died unexpectedly (status {dead[0].returncode})\n"
            )
            sys.stdout.flush()
            shutdown(workers, who)
            return 1
        if time.monotonic() - start > 300:
            sys.stdout.write("RuntimeError: workers not ready after 300 s\n")
            shutdown(workers, who)
            return 1
        time.sleep(0.05)
    say(who, f"Model loading took 0.01 GiB and {time.monotonic() - start:.2f} seconds", "gpu_model_runner.py:1")

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code = 200 if self.path in ("/health", "/ping") else 404
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, fmt: str, *a: object) -> None:
            return

    server = ThreadingHTTPServer((args.host, args.port), Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    say(who, f"Starting vLLM API server 0 on http://{args.host}:{args.port}", "api_server.py:1912")
    sys.stdout.write(f"INFO:     Started server process [{os.getpid()}]\n")
    sys.stdout.write("INFO:     Waiting for application startup.\n")
    sys.stdout.write("INFO:     Application startup complete.\n")
    sys.stdout.flush()
    while not stopping.is_set():
        time.sleep(0.05)  # a signal handler runs between sleeps: stop within ~50 ms
        dead = [w for w in workers if w.poll() is not None]
        if dead and not stopping.is_set():
            sys.stdout.write(f"RuntimeError: worker pid={dead[0].pid} died unexpectedly\n")
            sys.stdout.flush()
            shutdown(workers, who)
            return 1
    server.shutdown()
    return shutdown(workers, who)


def shutdown(workers: list[subprocess.Popen[bytes]], who: str) -> int:
    say(who, "Shutting down FastAPI HTTP server.", "launcher.py:1")
    for w in workers:
        with contextlib.suppress(ProcessLookupError):
            w.terminate()
    for w in workers:
        try:
            w.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_child.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    w = sub.add_parser("_worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--mib", type=int, required=True)
    w.add_argument("--master-port", type=int, required=True)
    w.add_argument("--ready", required=True)
    args = p.parse_args(argv)
    if args.cmd == "_worker":
        return worker(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
