"""Steps a and b: NVML facts, orphaned workers reaped by the preflight, a holder it must spare."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuaccept.gpu_tier.common import ENTRY, THRESHOLD_MIB, child_env, shm_listing
from gpuaccept.gpu_tier.ctx import Ctx, TimingTable, log_tail, make_config, wait_file
from gpuaccept.gpu_tier.gpus import Monitor, _s, comm
from gpuaccept.gpu_tier.roles import DECOY_VLLM_CODE
from testkit.procutil import live, proc_ppid, proc_state


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


@dataclasses.dataclass
class Scene:
    """What step b sets up and reports on: shm files, decoys, the stale tree; `res` is its section."""

    res: dict[str, Any]
    shm_before: set[str]
    held: Path
    stale: Path
    decoys: dict[str, int] = dataclasses.field(default_factory=dict)
    parent: subprocess.Popen[bytes] | None = None
    workers: list[int] = dataclasses.field(default_factory=list)
    winfo: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def step_orphans(ctx: Ctx) -> None:
    from kimi_supervisor.logs.journal import get_logger

    print("\n== b. orphans + decoys ==", flush=True)
    res: dict[str, Any] = {}
    ctx.result["orphans"] = res
    shm = Path(ctx.shm_dir)
    shm_before = set(shm_listing(ctx.shm_dir))
    res["shm_before"] = sorted(shm_before)
    sc = Scene(res, shm_before, shm / "psm_test_held", shm / "psm_test_stale")
    _start_decoys(ctx, sc)
    _start_stale_tree(ctx, sc)
    _record_names(sc)
    _check_nvml_lists_the_tree(ctx, sc)
    _orphan_the_workers(ctx, sc)
    cfg = make_config(ctx)
    log = get_logger()
    _dry_run(ctx, sc, cfg, log)
    table, mon, t_start, baseline = _real_run(ctx, sc, cfg, log)
    _timeline(sc, table, mon, t_start, baseline)
    ctx.result["orphans_ctx"] = {"decoys": sc.decoys, "held": str(sc.held)}


def _start_decoys(ctx: Ctx, sc: Scene) -> None:
    held, stale = sc.held, sc.stale
    # Decoys, each in its own session (as unrelated services would be).
    devs = ["/dev/nvidiactl", "/dev/nvidia0"] if not ctx.fake else ["/dev/null"]
    d_ctl = ctx.spawn(
        [sys.executable, str(ENTRY), "_decoy_ctl", "--ready", str(ctx.state / "decoy_ctl.ready"), "--hold", str(held)]
        + [x for d in devs for x in ("--dev", d)],
        "decoy_ctl.log",
    )
    d_vllm = ctx.spawn(
        [sys.executable, "-c", DECOY_VLLM_CODE, "vllm", "serve"],
        "decoy_vllm.log",
        env=child_env({"DECOY_READY": str(ctx.state / "decoy_vllm.ready")}),
    )
    stale.write_bytes(b"stale psm file nobody holds\n")
    wait_file(ctx.state / "decoy_ctl.ready", 30, [d_ctl])
    wait_file(ctx.state / "decoy_vllm.ready", 30, [d_vllm])
    decoys = {"decoy_ctl": d_ctl.pid, "decoy_vllm": d_vllm.pid}
    sc.decoys = decoys


def _start_stale_tree(ctx: Ctx, sc: Scene) -> None:
    res, decoys = sc.res, sc.decoys
    # The stale tree.
    t0 = time.monotonic()
    cmd = [sys.executable, str(ENTRY), "_parent", "--world", str(ctx.ngpu), "--mib", str(ctx.mib)]
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
    sc.parent, sc.workers, sc.winfo = parent, workers, winfo


def _record_names(sc: Scene) -> None:
    res, workers, decoys = sc.res, sc.workers, sc.decoys
    # What psutil and /proc show for the workers and decoys.
    import psutil

    names = {}
    for label, pid in [*(("worker", w) for w in workers), *decoys.items()]:
        p = psutil.Process(pid)
        names[str(pid)] = {
            "role": label,
            "psutil_name": p.name(),
            "comm": comm(pid),
            "cmdline": p.cmdline(),
        }
    res["names"] = names
    for pid, n in names.items():
        print(f"  PID {pid} {n['role']}: name()={n['psutil_name']!r} comm={n['comm']!r} cmdline={n['cmdline'][:4]}")


def _check_nvml_lists_the_tree(ctx: Ctx, sc: Scene) -> None:
    res, workers, winfo, decoys, shm_before = sc.res, sc.workers, sc.winfo, sc.decoys, sc.shm_before
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
    new_shm = sorted(set(shm_listing(ctx.shm_dir)) - shm_before - {"psm_test_held", "psm_test_stale"})
    res["shm_new_with_tree"] = new_shm
    res["shm_seen_by_workers"] = sorted({f for w in winfo for f in w.get("shm_after_init", [])} - shm_before)
    res["nccl_transport_lines"] = _nccl_transport(ctx)
    print(f"  new /dev/shm files while the tree runs: {new_shm}", flush=True)


def _orphan_the_workers(ctx: Ctx, sc: Scene) -> None:
    res, parent, workers, shm_before = sc.res, sc.parent, sc.workers, sc.shm_before
    assert parent is not None
    # Orphan them.
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    time.sleep(0.3)
    res["orphan_ppids"] = {str(w): proc_ppid(w) for w in workers}
    res["shm_after_orphaning"] = sorted(set(shm_listing(ctx.shm_dir)) - shm_before)
    used = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_orphaned"] = used
    print(f"  parent SIGKILLed; orphans' ppid now {res['orphan_ppids']}; used MiB {used}", flush=True)
    ctx.expect("orphans keep their memory", all(u > THRESHOLD_MIB for u in used), f"used={used}")
    ctx.expect("orphans alive", all(live(w) for w in workers))


def _dry_run(ctx: Ctx, sc: Scene, cfg: Any, log: Any) -> None:
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.preflight.report import render_text
    from kimi_supervisor.preflight.run import Preflight

    res, workers, held, stale = sc.res, sc.workers, sc.held, sc.stale
    # Dry run.
    table = TimingTable()
    t = time.monotonic()
    dry = Preflight(cfg, ctx.probe, table, SystemClock(), log).run(dry_run=True)
    res["dry_run_s"] = round(time.monotonic() - t, 4)
    text = render_text(dry, "gpu-tier")
    res["dry_run_report"] = text.splitlines()
    res["dry_run"] = dry.to_dict()
    print(text, flush=True)
    would_kill = sorted(c.data["pid"] for c in dry.checks if c.name == "reap" and c.verdict.value == "would kill")
    ctx.expect("dry run: 'would kill' lists exactly the orphans", would_kill == sorted(workers), f"{would_kill}")
    ctx.expect("dry run signalled nothing", not table.sent)
    ctx.expect("dry run verdict: start would proceed", dry.proceed)
    ctx.expect("dry run: stale shm 'would remove'", _shm_status(dry, stale) == "would remove")
    ctx.expect("dry run: held shm 'keep'", _shm_status(dry, held) == "keep")
    ctx.expect("orphans still alive after dry run", all(live(w) for w in workers))


def _real_run(ctx: Ctx, sc: Scene, cfg: Any, log: Any) -> tuple[TimingTable, Monitor, float, list[int]]:
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.preflight.report import render_text
    from kimi_supervisor.preflight.run import Preflight

    res, workers, decoys, held, stale, shm_before = sc.res, sc.workers, sc.decoys, sc.held, sc.stale, sc.shm_before
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
    left = sorted(set(shm_listing(ctx.shm_dir)) - shm_before - {"psm_test_held"})
    res["shm_left_after"] = left
    ctx.expect("no NCCL/psm shm file left behind", not left, f"left={left}")
    used_after = [ctx.gpus.used_mib(i) for i in range(ctx.ngpu)]
    res["used_mib_after"] = used_after
    ctx.expect("memory returned on every GPU", all(u <= THRESHOLD_MIB for u in used_after), f"used={used_after}")
    return table, mon, t_start, baseline


def _timeline(sc: Scene, table: TimingTable, mon: Monitor, t_start: float, baseline: list[int]) -> None:
    res, workers = sc.res, sc.workers
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


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _shm_status(report: Any, path: Path) -> str | None:
    for c in report.checks:
        if c.name == "shm" and c.data.get("path") == str(path):
            return str(c.verdict.value)
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
    from kimi_supervisor.logs.journal import get_logger
    from kimi_supervisor.preflight.report import render_text
    from kimi_supervisor.preflight.run import Preflight

    print("\n== b(ii). a GPU holder that matches no kill rule ==", flush=True)
    res: dict[str, Any] = {}
    ctx.result["holder"] = res
    cmd = [sys.executable, str(ENTRY), "_holder", "--gpu", "0", "--mib", str(ctx.mib)]
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
