"""The processes the GPU tier starts through `gpuaccept/gpu_tier _<role>`: TP workers, their stale parent, decoys, a holder.

Stdlib (and torch on the device) only: they start fast and import nothing of the supervisor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from gpuaccept.gpu_tier.common import ENTRY, child_env, hold_gpu_memory, nccl_all_reduce, shm_listing, write_json
from testkit.procutil import free_port, set_comm


def sub_worker(a: argparse.Namespace) -> int:
    """One 'TP worker': comm name, MIB MiB on its GPU, NCCL all_reduce, sleep."""
    set_comm(a.name)
    info: dict[str, Any] = {"pid": os.getpid(), "rank": a.rank, "gpu": a.gpu, "comm_set": a.name}
    hold = hold_gpu_memory(a.gpu, a.mib, a.fake_dir)
    if not a.fake_dir:
        import torch

        info["held_bytes"] = hold.numel()
        if a.world > 1:
            info.update(nccl_all_reduce(a.rank, a.gpu, a.world, a.master_port))
        torch.cuda.synchronize()
        info["torch"] = torch.__version__
    info["shm_after_init"] = shm_listing(a.shm_dir)
    write_json(a.ready, info)
    while True:
        time.sleep(3600)


def sub_parent(a: argparse.Namespace) -> int:
    """The stale tree's root: spawns one worker per GPU, waits, sleeps until SIGKILLed."""
    set_comm("stale_parent")
    port = free_port()
    procs = []
    for rank in range(a.world):
        ready = os.path.join(a.state, f"worker{rank}.ready")
        cmd = [
            sys.executable,
            str(ENTRY),
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
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env()))
    while not all(os.path.exists(os.path.join(a.state, f"worker{r}.ready")) for r in range(a.world)):
        if any(p.poll() is not None for p in procs):
            write_json(os.path.join(a.state, "parent.failed"), {"codes": [p.poll() for p in procs]})
            return 1
        time.sleep(0.05)
    write_json(os.path.join(a.state, "parent.ready"), {"pid": os.getpid(), "workers": [p.pid for p in procs]})
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
    write_json(
        a.ready, {"pid": os.getpid(), "devices": [d for d, h in zip(a.dev, held, strict=False) if h is not None]}
    )
    while True:
        time.sleep(3600)


def sub_holder(a: argparse.Namespace) -> int:
    """A GPU holder whose name matches no kill rule (a 'trainer')."""
    set_comm("trainer")
    hold = hold_gpu_memory(a.gpu, a.mib, a.fake_dir)
    if not a.fake_dir:
        import torch

        torch.cuda.synchronize()
        assert hold.numel() > 0
    write_json(a.ready, {"pid": os.getpid()})
    while True:
        time.sleep(3600)


# The vllm-looking decoy: `python3 -c CODE vllm serve` named VLLM::Worker_TP9, no GPU.
DECOY_VLLM_CODE = (
    "import ctypes,json,os,sys,time;"
    "ctypes.CDLL(None).prctl(15,ctypes.c_char_p(b'VLLM::Worker_TP9'[:15]),0,0,0);"
    "p=os.environ['DECOY_READY'];open(p+'.tmp','w').write(json.dumps({'pid':os.getpid()}));os.replace(p+'.tmp',p);"
    "time.sleep(86400)"
)
