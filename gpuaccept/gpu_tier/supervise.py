"""Step c: the real CLI supervising gpuaccept/gpu_child.py: ready, SIGTERM, the tree gone, the GPUs free."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuaccept.gpu_tier.common import REPO, THRESHOLD_MIB, child_env, gpu_child_section, shm_listing, write_gpu_config
from gpuaccept.gpu_tier.ctx import Ctx
from gpuaccept.gpu_tier.gpus import Monitor, comm
from testkit.procutil import free_port


def step_supervisor(ctx: Ctx) -> None:
    print("\n== c. supervisor: ready, SIGTERM, tree gone, GPUs free ==", flush=True)
    res: dict[str, Any] = {}
    ctx.result["supervisor"] = res
    cfg_path = _write_config(ctx, res)
    run = _start(ctx, res, cfg_path)
    if not _wait_ready(ctx, res, run):
        return
    tree, rc = _stop_and_watch(ctx, res, run)
    _check_stopped_clean(ctx, res, tree, rc)


def _write_config(ctx: Ctx, res: dict[str, Any]) -> Path:
    port = free_port()
    fake_env = {"GPU_CHILD_FAKE": "1", "GPU_CHILD_FAKE_DIR": ctx.fake_dir} if ctx.fake_dir else {}
    child = gpu_child_section(port, ctx.ngpu, ctx.mib, str(ctx.state / "child"), **fake_env)
    # Fake mode: the CLI's own NvmlProbe has no GPU to see.
    preflight = ["deadline_s = 30", *(["gpus = []"] if ctx.fake else [])]
    cfg_path = ctx.state / "supervisor.toml"
    write_gpu_config(cfg_path, child, ctx.shm_dir, preflight)
    res["config"] = cfg_path.read_text().splitlines()
    return cfg_path


@dataclasses.dataclass
class _Run:
    """The supervisor under test: its process, its JSON events and child lines as they arrive."""

    sup: subprocess.Popen[bytes]
    t0: float
    events: list[tuple[float, dict[str, Any]]]
    child_lines: list[tuple[float, str]]
    lock: threading.Lock
    threads: list[threading.Thread]
    event: Callable[[str], tuple[float, dict[str, Any]] | None]


def _start(ctx: Ctx, res: dict[str, Any], cfg_path: Path) -> _Run:
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

    return _Run(sup, t0, events, child_lines, lock, threads, event)


def _wait_ready(ctx: Ctx, res: dict[str, Any], run: _Run) -> bool:
    sup, t0, events, child_lines, lock, event = run.sup, run.t0, run.events, run.child_lines, run.lock, run.event
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
        return False
    return True


def _stop_and_watch(ctx: Ctx, res: dict[str, Any], run: _Run) -> tuple[list[int], int]:
    import psutil

    sup, events, child_lines, lock, threads, event = (
        run.sup,
        run.events,
        run.child_lines,
        run.lock,
        run.threads,
        run.event,
    )
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
    return tree, rc


def _check_stopped_clean(ctx: Ctx, res: dict[str, Any], tree: list[int], rc: int) -> None:
    import psutil

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
