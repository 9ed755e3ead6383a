"""What every part of the GPU tier shares: paths, the safe environment, small file and number helpers."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Mandatory on the multi-GPU machines: NVLink multicast stays off everywhere,
# also in every process started from here (they inherit os.environ).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)

REPO = Path(__file__).resolve().parents[2]
ENTRY = Path(__file__).resolve().parent  # the subprocess roles run through it (`python3 gpuaccept/gpu_tier _<role>`)
MIB = 1024 * 1024
THRESHOLD_MIB = 1000  # the supervisor's default preflight.memory_threshold_mib


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def hold_gpu_memory(gpu: int, mib: int, fake_dir: str | None) -> Any:
    """Take MIB MiB on GPU: a torch tensor (keep it referenced); with FAKE_DIR, a file the fake probe counts
    instead, and None."""
    if fake_dir:
        d = os.path.join(fake_dir, f"gpu{gpu}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, str(os.getpid())), "w") as fh:
            fh.write(str(mib))
        return None
    import torch

    torch.cuda.set_device(gpu)
    return torch.empty(mib * MIB, dtype=torch.uint8, device=f"cuda:{gpu}")


def nccl_all_reduce(rank: int, gpu: int, world: int, master_port: int) -> dict[str, Any]:
    """A TP worker's start: join the NCCL group of WORLD ranks (rendezvous at 127.0.0.1:MASTER_PORT) and
    all_reduce a tensor of ones on GPU; says whether the sum came back right, how long it took, NCCL's version."""
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{master_port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", gpu),
    )
    t = torch.ones(1 << 20, device=f"cuda:{gpu}")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    info: dict[str, Any] = {"allreduce_ok": float(t[0].item()) == float(world)}
    info["nccl_init_allreduce_s"] = round(time.monotonic() - t0, 3)
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return info


def shm_listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def scene_start(prefix: str, mib: int, description: str | None = None) -> tuple[Any, Path, dict[str, str]]:
    """A device scene's start: its --out and --mib, a fresh work directory, and the environment its supervisors
    run in (the safe NCCL settings, this checkout first on PYTHONPATH)."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, default=mib)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(REPO)]))
    return args, work, env


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
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


def gpu_child_section(port: int, ngpu: int, mib: int, rundir: str, **env: str) -> list[str]:
    """The config's [child] lines: gpuaccept/gpu_child.py as `vllm serve`, one MIB-MiB worker per GPU, NCCL over /dev/shm."""
    argv = ["python3", str(REPO / "gpuaccept" / "gpu_child.py"), "serve", "/tmp/x", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--tensor-parallel-size", str(ngpu)]
    child = {**SAFE_ENV, "GPU_CHILD_MIB": str(mib), "GPU_CHILD_RUNDIR": rundir}
    child.update({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0", **env})
    return [
        "[child]",
        "argv = [" + ", ".join(json.dumps(a) for a in argv) + "]",
        "[child.env]",
        *(f"{k} = {json.dumps(v)}" for k, v in child.items()),
    ]


def write_gpu_config(
    path: Path, child: list[str], shm_dir: str, preflight: list[str], tail: Sequence[str] = ()
) -> None:
    """The supervisor's config around gpuaccept/gpu_child.py, mode 0600: CHILD (gpu_child_section's lines), the
    PREFLIGHT lines (the model check is off: the child loads none), bounds for a load of minutes, then TAIL."""
    lines = [
        *child,
        "[preflight]",
        "check_model = false",
        *preflight,
        "[preflight.shm]",
        f"directory = {json.dumps(shm_dir)}",
        "[readiness]",
        "deadline_s = 240",
        "stall_timeout_s = 200",
        "[shutdown]",
        "grace_s = 30",
        "gpu_release_timeout_s = 30",
        *tail,
    ]
    path.write_text("\n".join(lines) + "\n")
    os.chmod(path, 0o600)


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
