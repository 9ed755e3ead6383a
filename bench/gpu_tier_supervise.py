"""Steps c and d: the real CLI supervising bench/gpu_child.py, and the preflight benchmark."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from bench.gpu_tier_common import REPO, THRESHOLD_MIB, child_env, gpu_child_section, shm_listing, summary
from bench.gpu_tier_ctx import Ctx, make_config
from bench.gpu_tier_gpus import Monitor, comm
from tests.procutil import free_port


def step_supervisor(ctx: Ctx) -> None:
    print("\n== c. supervisor: ready, SIGTERM, tree gone, GPUs free ==", flush=True)
    import psutil

    res: dict[str, Any] = {}
    ctx.result["supervisor"] = res
    port = free_port()
    fake_env = {"GPU_CHILD_FAKE": "1", "GPU_CHILD_FAKE_DIR": ctx.fake_dir} if ctx.fake_dir else {}
    toml = [
        *gpu_child_section(port, ctx.ngpu, ctx.mib, str(ctx.state / "child"), **fake_env),
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
    senv = child_env()
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
    res["tree"] = {str(p): comm(p) for p in tree}
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
    res["shm_after_stop"] = shm_listing(ctx.shm_dir)
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
