"""Step d: the preflight on clean GPUs against the seeds' nvidia-smi loop, and NVML call latency."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from gpuaccept.gpu_tier.common import REPO, child_env, summary
from gpuaccept.gpu_tier.ctx import Ctx, make_config
from testkit.procutil import free_port

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
    print("\n== d. benchmark on clean GPUs ==", flush=True)
    res: dict[str, Any] = {"reps": ctx.reps}
    ctx.result["bench"] = res
    warm_probe = _bench_warm_preflight(ctx, res)
    _bench_cli_dry_run(ctx, res)
    _bench_seed_loops(ctx, res)
    _bench_nvml_latency(ctx, res, warm_probe)
    _bench_table(res)


def _bench_warm_preflight(ctx: Ctx, res: dict[str, Any]) -> Any:
    import structlog

    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.host.nvml import NvmlProbe
    from kimi_supervisor.host.proctable import PsutilProcessTable
    from kimi_supervisor.preflight.run import Preflight

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
    return warm_probe


def _bench_cli_dry_run(ctx: Ctx, res: dict[str, Any]) -> None:
    # End to end, as an ExecStartPre would pay it: a new process, imports, nvmlInit, preflight.
    cfg_path = ctx.state / "bench.toml"
    cfg_path.write_text(
        '[child]\nargv = ["vllm", "serve", "/tmp/x", "--port", "%d", "--tensor-parallel-size", "%d"]\n'
        "[preflight]\ncheck_model = false\ngpus = %s\n%s"
        % (
            free_port(),
            ctx.ngpu,
            json.dumps(list(range(ctx.ngpu))) if not ctx.fake else "[]",
            f"[preflight.shm]\ndirectory = {json.dumps(ctx.shm_dir)}\n",
        )
    )
    os.chmod(cfg_path, 0o600)
    cenv = child_env()
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


def _bench_seed_loops(ctx: Ctx, res: dict[str, Any]) -> None:
    benv = child_env()
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


def _bench_nvml_latency(ctx: Ctx, res: dict[str, Any], warm_probe: Any) -> None:
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


def _bench_table(res: dict[str, Any]) -> None:
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
