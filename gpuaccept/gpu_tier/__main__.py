#!/usr/bin/env python3
"""The real-GPU tier of kimi-supervisor: NVML facts, orphan reaping, stop, benchmark.

    python3 gpuaccept/gpu_tier --out DIR [--mib 4096] [--reps 20] [--fake]

Writes DIR/gpu_tier.json and DIR/gpu_tier.md and prints a readable report.

  a. NVML facts per GPU: v1 vs v2 memory, compute-process PIDs vs ours, /proc.
  b. Orphans: a stale parent spawns one torch worker per GPU (comm
     VLLM::Worker_TP<i>, NCCL group on 2+ GPUs, MIB MiB each), then is
     SIGKILLed; decoys that must survive; stale/held shm files; the supervisor's
     Preflight dry run, then the real run, timed against NVML and /proc.
     Then a GPU holder that matches no kill rule: the preflight must fail and
     kill nothing.
  c. The real CLI supervising gpuaccept/gpu_child.py: ready, SIGTERM, tree gone,
     GPUs free, exit code.
  d. Preflight wall time on clean GPUs vs the seeds' nvidia-smi bash loop;
     NVML and nvidia-smi call latency.

(also `python3 -m gpuaccept.gpu_tier ...`). Modules of this package: roles.py (the processes started as
`gpuaccept/gpu_tier _<role>`), gpus.py (NVML or the fake GPUs, the monitor), ctx.py (the run's context and
teardown), preflight.py (a, b), supervise.py (c), bench.py (d), report.py (the JSON and Markdown).

--fake runs the same orchestration with no GPU (a probe that counts live
worker PIDs as memory) to test this script's logic on a CPU machine.
Every process this script signals is one it started (or one the supervisor's
preflight reaps, which are the orphaned workers this script started).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# Run as `python3 gpuaccept/gpu_tier` (here, and as every subprocess role): the repository is the import root, in
# place of this folder, whose modules (bench.py, common.py, ...) must not shadow top-level names.
if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from gpuaccept.gpu_tier.common import SAFE_ENV, child_env
from gpuaccept.gpu_tier.roles import sub_decoy_ctl, sub_holder, sub_parent, sub_worker


def main_bench(a: argparse.Namespace) -> int:
    # Imported here: the subprocess roles need none of this (nor the supervisor).
    from gpuaccept.gpu_tier.bench import step_bench
    from gpuaccept.gpu_tier.ctx import Ctx, Tee, cleanup, end_decoys
    from gpuaccept.gpu_tier.gpus import FakeProbe, Gpus
    from gpuaccept.gpu_tier.preflight import step_facts_idle, step_holder, step_orphans
    from gpuaccept.gpu_tier.report import write_outputs
    from gpuaccept.gpu_tier.supervise import step_supervisor
    from kimi_supervisor.logs.journal import configure

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
        from kimi_supervisor.host.nvml import NvmlProbe

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
        "nccl_env": {k: v for k, v in child_env().items() if k.startswith("NCCL_")},
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
    return main_bench(a)


if __name__ == "__main__":
    sys.exit(main())
