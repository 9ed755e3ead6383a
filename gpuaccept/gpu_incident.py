#!/usr/bin/env python3
"""Issue 35 on a real GPU: an incident's forensics, an unkillable worker, and where a start's time goes.

    python3 gpuaccept/gpu_incident.py --out DIR [--mib 4096] [--fake] [--steps cab]

Writes DIR/gpu_incident.json (every number, every event) and DIR/gpu_incident.md (the checks, PASS/FAIL).

  c. Start -> spawn: `python3 -X importtime` of the supervisor's start path (kimi_supervisor.cli, what
     `python3 -m kimi_supervisor` imports before its first line runs), the top cumulative imports, with this
     tree's bytecode absent (a fresh copy run with PYTHONDONTWRITEBYTECODE=1, as bench/bench_lifecycle.py's
     row 11 runs it) and compiled (as an installed package has it); the same row's start -> spawn both ways;
     NvmlProbe's init and each query it makes, and `--dry-run` (config, preflight) with GPU 0 and with none.
     Runs first: the tree is still as it was carried.
  a. Forensics: a process of ours (comm VLLM::Worker_TP0) loops matmuls on GPU 0 in `matmul_loop`, some GiB
     allocated; opsview/forensics.py's `capture` with the real NvmlProbe and the real py-spy dumper, an NCCL RAS
     address nobody listens on; the incident saved by its IncidentStore.  Checks: the stack names `matmul_loop`,
     NVML shows the memory and the process, non-zero utilisation, clocks, the health counters, the capture
     within forensics.BUDGET_S, the RAS note.
  b. Unkillable: the real CLI supervises gpuaccept/gpu_child.py (one worker holding real memory on GPU 0); after
     READY the worker is frozen by testkit/freezer.py's cgroup-v1 freezer (D state, its SIGKILL pending: what
     vLLM's EngineCore stuck in nvidia_uvm looks like); SIGTERM: exit 22 naming GPU 0 (from NVML's process
     list), the PID, its state and wait channel; a second start's preflight exits 22 at once naming it; then the
     thaw ends it and GPU 0's memory comes back.  Where the freezer cannot be mounted, b says why and is skipped.

--fake: no torch, no NVML (this CPU machine): a pure-Python loop stands in for the matmuls, testkit/fakes/gpu.py's
probe for NVML, gpu_child.py's GPU_CHILD_FAKE for the worker's memory; the logic and the checks are the same.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaccept.gpu_tier.common import SAFE_ENV, write_json  # noqa: E402
from gpuaccept.weights_common import md_table  # noqa: E402
from testkit.procutil import free_port, set_comm  # noqa: E402

MIB = 1 << 20
CHECKS: list[tuple[str, str, bool | None, str]] = []  # step, name, ok (None: skipped), detail
WORKER_COMM = "VLLM::Worker_TP0"
GRACE_S = 2.0
PREFLIGHT_DEADLINE_S = 120.0  # far beyond the reap's grace + SIGKILL wait: a start that waited it out would show
GPU_RELEASE_TIMEOUT_S = 120.0  # likewise for the stop: exit 22 comes before it
IMPORT_RUNS = 7
TOP_IMPORTS = 20


def expect(step: str, name: str, ok: bool | None, detail: Any = "") -> bool:
    text = detail if isinstance(detail, str) else json.dumps(detail, default=str)
    CHECKS.append((step, name, ok, text[:600]))
    print(f"  [{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}] {step}. {name}: {text[:300]}", flush=True)
    return bool(ok)


def wait_for(what: Callable[[], Any], timeout: float, every: float = 0.05) -> Any:
    """`what()`'s first true answer, or its last answer once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


class Events:
    """A Logger (kimi_supervisor/logs/types.py) that keeps what the capture logs."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def _keep(self, level: str, event: str, **fields: Any) -> None:
        self.records.append({"level": level, "event": event, **fields})

    def debug(self, event: str, **fields: Any) -> None:
        self._keep("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._keep("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._keep("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._keep("error", event, **fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._keep("critical", event, **fields)


# -- the busy worker of step a -------------------------------------------------------------------------------


def matmul_loop(mib: int, ready: str, fake: bool) -> None:
    """Multiply on GPU 0 until killed; READY is written once the loop runs (and the memory is held)."""
    if fake:
        rows = [[float(i * j % 7) for j in range(48)] for i in range(48)]
        done = 0
        while True:
            cols = list(zip(*rows, strict=True))
            rows = [[sum(a * b for a, b in zip(r, c, strict=True)) % 11.0 for c in cols] for r in rows]
            done += 1
            if done == 3:
                write_json(ready, {"pid": os.getpid(), "iterations": done})
    import torch

    torch.cuda.set_device(0)
    held = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda:0")
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda:0", dtype=torch.float16)
    done = 0
    while True:
        for _ in range(16):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()
        done += 1
        if done == 3:
            write_json(ready, {"pid": os.getpid(), "iterations": done, "held_bytes": held.numel()})


def busy_main(args: argparse.Namespace) -> int:
    set_comm(WORKER_COMM)
    matmul_loop(args.mib, args.ready, args.fake)
    return 0


# -- step c: where a start's time goes -----------------------------------------------------------------------


def tree_copy(dest: Path, compiled: bool) -> Path:
    """kimi_supervisor/ copied without its bytecode (what a fresh carried checkout has) or compiled (what an
    installed package has, pip compiles on install): DEST, to put first on sys.path."""
    shutil.copytree(REPO / "kimi_supervisor", dest / "kimi_supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    if compiled:
        compileall.compile_dir(str(dest / "kimi_supervisor"), quiet=1)
    return dest


def interleaved(argv: list[str], envs: dict[str, dict[str, str]], runs: int) -> dict[str, list[float]]:
    """Wall ms of ARGV under each of ENVS, one run of each in turn: a machine's changing load falls on all alike."""
    took: dict[str, list[float]] = {k: [] for k in envs}
    for _ in range(runs):
        for label, env in envs.items():
            t0 = time.monotonic()
            subprocess.run(argv, env=env, cwd="/", check=True, capture_output=True, timeout=120)
            took[label].append(round((time.monotonic() - t0) * 1000, 1))
    return took


def importtime_top(env: dict[str, str]) -> tuple[float, list[dict[str, Any]]]:
    """`-X importtime` of kimi_supervisor.cli: its total (ms) and the TOP_IMPORTS largest cumulative entries."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kimi_supervisor.cli"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append(
                {"self_ms": int(m[1]) / 1000, "cum_ms": int(m[2]) / 1000, "depth": len(m[3]) // 2, "name": m[4]}
            )
    total = next((r["cum_ms"] for r in rows if r["name"] == "kimi_supervisor.cli"), float("nan"))
    top = sorted(rows, key=lambda r: -r["cum_ms"])[:TOP_IMPORTS]
    return total, top


def nvml_times(fake: bool) -> dict[str, Any]:
    """NvmlProbe's first call (NVML's init inside it) and each query a start's preflight makes, in ms."""
    if fake:
        return {"skipped": "--fake: no NVML"}
    t0 = time.monotonic()
    import pynvml  # noqa: F401  (timed: the probe imports it on its first call)

    out: dict[str, Any] = {"import_pynvml_ms": round((time.monotonic() - t0) * 1000, 2)}
    from kimi_supervisor.host.nvml import NvmlProbe

    probe = NvmlProbe()
    for name, call in (
        ("device_count_with_init", probe.device_count),
        ("memory_0", lambda: probe.memory(0)),
        ("processes_0", lambda: probe.processes(0)),
        ("health_0", lambda: probe.health(0)),
        ("activity_0", lambda: probe.activity(0)),
        ("memory_0_again", lambda: probe.memory(0)),
    ):
        t = time.monotonic()
        call()
        out[f"{name}_ms"] = round((time.monotonic() - t) * 1000, 2)
    probe.close()
    return out


def dry_run_times(work: Path, env: dict[str, str], fake: bool) -> dict[str, Any]:
    """`--dry-run` (config, checks, the preflight's report) with GPU 0 configured and with none, wall ms."""
    out: dict[str, Any] = {}
    for label, gpus in (("gpus_none", []), ("gpu_0", [0])):
        if fake and gpus:
            out[label] = "skipped: --fake"
            continue
        d = work / f"dry-{label}"
        d.mkdir()
        cfg = supervisor_config(d, fake=fake, gpus=gpus)
        argv = [sys.executable, "-m", "kimi_supervisor", "--config", str(cfg), "--dry-run"]
        took, codes = [], []
        for _ in range(3):
            t0 = time.monotonic()
            r = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
            took.append(round((time.monotonic() - t0) * 1000, 1))
            codes.append(r.returncode)
        out[label] = {"ms": took, "exit_codes": codes, "tail": (r.stdout + r.stderr)[-400:]}
    return out


def step_c(res: dict[str, Any], work: Path, fake: bool) -> None:
    print("\n== c. start -> spawn: imports, NVML, preflight ==", flush=True)
    c: dict[str, Any] = {}
    res["c"] = c
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # PYTHONDONTWRITEBYTECODE=1, as row 11 runs the supervisor: the source copy stays without bytecode.
    trees = {"source": tree_copy(work / "source", False), "compiled": tree_copy(work / "compiled", True)}
    envs = {"bare": env, **{k: {**env, "PYTHONPATH": str(t), "PYTHONDONTWRITEBYTECODE": "1"} for k, t in trees.items()}}
    runs = interleaved([sys.executable, "-c", "import kimi_supervisor.cli"], envs, IMPORT_RUNS)
    runs["bare"] = interleaved([sys.executable, "-c", "pass"], {"bare": env}, IMPORT_RUNS)["bare"]
    c["import_ms"] = runs
    for label in trees:
        c[f"importtime_{label}_total_ms"], c[f"importtime_{label}_top"] = importtime_top(envs[label])
    from bench import bench_lifecycle

    rows = bench_lifecycle.spawn_rows((trees["source"], trees["compiled"]), compile_first=False)
    c["spawn_rows"] = {label: dataclasses.asdict(row) for label, row in zip(trees, rows, strict=True)}
    c["nvml"] = nvml_times(fake)
    c["dry_run"] = dry_run_times(work, env, fake)
    med = {k: statistics.median(v) for k, v in runs.items()}
    c["import_median_ms"] = med
    print(json.dumps({k: v for k, v in c.items() if not k.endswith("_top")}, indent=1, default=str), flush=True)
    for label in trees:
        top = ", ".join(f"{r['name']} {r['cum_ms']:.0f}" for r in c[f"importtime_{label}_top"][:8])
        print(f"  importtime, {label}: {top}", flush=True)
    expect(
        "c",
        "importing the start path (kimi_supervisor.cli) from source costs more than from compiled bytecode",
        med["source"] > med["compiled"],
        f"median ms: bare python {med['bare']}, source {med['source']}, compiled {med['compiled']}",
    )
    for label, row in c["spawn_rows"].items():
        expect("c", f"row 11, start -> spawn, {label} tree (<= 300 ms)", row["ok"], row["measured"])


# -- step a: forensics on a real GPU -------------------------------------------------------------------------


@contextlib.contextmanager
def busy_worker(work: Path, mib: int, fake: bool) -> Iterator[subprocess.Popen[bytes]]:
    ready = work / "busy.ready"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_busy", "--mib", str(mib), "--ready", str(ready)]
    proc = subprocess.Popen([*cmd, *(["--fake"] if fake else [])], env={**os.environ, **SAFE_ENV})
    try:
        if not wait_for(lambda: ready.exists() or proc.poll() is not None, 180) or not ready.exists():
            raise RuntimeError(f"the busy worker did not start (exit {proc.poll()})")
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


def step_a(res: dict[str, Any], work: Path, mib: int, fake: bool, pyspy: str | None) -> None:
    print("\n== a. forensics: py-spy and NVML on a busy worker ==", flush=True)
    from kimi_supervisor.opsview import forensics

    a: dict[str, Any] = {}
    res["a"] = a
    dumper, note = forensics.default_dumper() if pyspy is None else (forensics.PySpyDumper(pyspy), pyspy)
    a["dumper"] = note
    with busy_worker(work, mib, fake) as proc:
        probe = fake_probe({proc.pid: mib}) if fake else nvml_probe()
        log = Events()
        ras_port = free_port()
        scene = forensics.Scene(
            "gpu_incident.py: a worker judged hung (step a)",
            17,
            [(proc.pid, WORKER_COMM)],
            probe,
            (0,),
            None,
            ("127.0.0.1", ras_port),
        )
        incident = forensics.capture(scene, dumper, note, clock=time.monotonic, wall=time.time, log=log)
        path = forensics.IncidentStore(work / "incidents").save(incident)
        a["worker_pid"] = proc.pid
        a["incident_file"] = {"name": path.name, "mode": oct(path.stat().st_mode & 0o777)}
        a["incident"] = json.loads(path.read_text())
        a["log"] = log.records
        probe.close()
    doc = a["incident"]
    stack = doc["stacks"][0] if doc["stacks"] else {}
    print(f"  py-spy ({stack.get('seconds')} s):\n{stack.get('text') or stack.get('error')}", flush=True)
    expect(
        "a",
        "py-spy's stack of the worker names the function it loops in (matmul_loop)",
        stack.get("error") is None and "matmul_loop" in (stack.get("text") or ""),
        stack.get("error") or (stack.get("text") or "")[:300],
    )
    gpu = doc["gpus"][0]
    used, pids = gpu["memory"].get("used_mib", 0), [p["pid"] for p in gpu["processes"]]
    expect("a", f"NVML: GPU 0 shows >= {mib} MiB used and the worker's PID", used >= mib and proc.pid in pids, gpu)
    act = gpu["activity"]
    expect(
        "a",
        "NVML: non-zero utilisation and clocks",
        (act.get("gpu_util_pct") or 0) > 0 and (act.get("sm_clock_mhz") or 0) > 0,
        act,
    )
    health = gpu["health"]
    counters = ("remapped_rows_pending", "remapped_rows_uncorrectable", "ecc_uncorrected_volatile")
    expect(
        "a",
        "NVML: the health counters are read (remaps, uncorrected ECC)",
        "error" not in health and all(health.get(k) is not None for k in counters),
        {k: health.get(k) for k in (*counters, "errors")},
    )
    expect(
        "a",
        f"the capture took <= forensics.BUDGET_S ({forensics.BUDGET_S:g} s)",
        doc["seconds"] <= forensics.BUDGET_S,
        f"{doc['seconds']} s (stacks {doc['stacks_s']} s)",
    )
    ras = doc["nccl_ras"] or {}
    expect(
        "a",
        "NCCL RAS: no listener is one note",
        ras.get("text") is None and str(ras.get("note", "")).startswith("no RAS listener"),
        ras,
    )
    expect("a", "the incident file is 0600", a["incident_file"]["mode"] == "0o600", a["incident_file"])


def fake_probe(occupants: dict[int, int]) -> Any:
    from testkit.fakes.gpu import FakeGpu, FakeGpuProbe

    return FakeGpuProbe([FakeGpu(total_mib=143771, occupants=occupants)])


def nvml_probe() -> Any:
    from kimi_supervisor.host.nvml import NvmlProbe

    return NvmlProbe()


# -- step b: an unkillable worker ----------------------------------------------------------------------------


def supervisor_config(d: Path, *, fake: bool, gpus: list[int], mib: int = 1024) -> Path:
    from testkit.harness import write_config

    port = free_port()
    argv = [sys.executable, str(REPO / "gpuaccept" / "gpu_child.py"), "serve", "/tmp/x", "--port", str(port)]
    argv += ["--host", "127.0.0.1", "--tensor-parallel-size", "1"]
    env = {**SAFE_ENV, "GPU_CHILD_MIB": str(mib), "GPU_CHILD_RUNDIR": str(d / "child")}
    if fake:
        env.update({"GPU_CHILD_FAKE": "1", "GPU_CHILD_FAKE_DIR": str(d / "fakegpu")})
    (d / "shm").mkdir(exist_ok=True)
    return write_config(
        d / "kimi.toml",
        {
            "deployment": {"name": "kimi"},
            "child": {"argv": argv, "env": env},
            "preflight": {"gpus": gpus, "check_model": False, "deadline_s": PREFLIGHT_DEADLINE_S},
            "preflight.reap": {"grace_s": 0.5},
            "preflight.shm": {"directory": str(d / "shm")},
            "readiness": {"deadline_s": 240, "stall_timeout_s": 200},
            "shutdown": {"grace_s": GRACE_S, "gpu_release_timeout_s": GPU_RELEASE_TIMEOUT_S},
        },
    )


def fake_gpus(path: Path, occupants: dict[int, int]) -> None:
    path.write_text(json.dumps([{"total_mib": 143771, "occupants": {str(p): m for p, m in occupants.items()}}]))


def step_b(res: dict[str, Any], work: Path, mib: int, fake: bool) -> None:
    print("\n== b. unkillable: a frozen worker on GPU 0 ==", flush=True)
    from testkit.freezer import Freezer, FreezerUnavailable

    b: dict[str, Any] = {}
    res["b"] = b
    try:
        freezer = Freezer(work)
    except (FreezerUnavailable, OSError) as exc:
        b["skipped"] = f"the cgroup-v1 freezer cannot be mounted here: {exc}"
        expect("b", "unkillable worker (skipped)", None, b["skipped"])
        return
    try:
        unkillable(b, freezer, work, mib, fake)
    finally:
        freezer.close()  # thawed, emptied, unmounted however the step ended


def unkillable(b: dict[str, Any], freezer: Any, work: Path, mib: int, fake: bool) -> None:
    import psutil

    from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
    from testkit.harness import Run

    d = work / "b"
    d.mkdir()
    cfg = supervisor_config(d, fake=fake, gpus=[0], mib=mib)
    gpus_file = d / "gpus.json"
    fake_gpus(gpus_file, {})
    entry = ["-m", "testkit.fakes.gpu_cli", str(gpus_file)] if fake else ["-m", "kimi_supervisor"]
    probe = None if fake else nvml_probe()
    idle_mib = None if probe is None else probe.memory(0).used_mib
    b["idle_used_mib"] = idle_mib
    run = Run(cfg, d, entry=entry)
    pid = None
    try:
        run.wait_event("state.ready", timeout=240)
        sup = psutil.Process(run.proc.pid)
        worker = wait_for(
            lambda: next((p for p in sup.children(recursive=True) if p.name() == WORKER_COMM[:15]), None), 30
        )
        if worker is None:
            raise RuntimeError(f"no {WORKER_COMM} in the supervisor's tree")
        pid = worker.pid
        child = psutil.Process(run.child_pid)
        b["start_to_spawn_s"] = round(child.create_time() - sup.create_time(), 3)
        b["worker_pid"] = pid
        if fake:
            fake_gpus(gpus_file, {pid: mib})
        else:
            b["nvml_before_freeze"] = {
                "used_mib": probe.memory(0).used_mib,
                "processes": [dataclasses.asdict(p) for p in probe.processes(0)],
            }
        freezer.freeze([pid])
        status = Path(f"/proc/{pid}/status").read_text()
        state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "")
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        b["frozen"] = {"state": state, "wchan": wchan}
        with contextlib.suppress(OSError):
            b["frozen"]["stack"] = Path(f"/proc/{pid}/stack").read_text()[:2000]
        expect("b", "the frozen worker is in D state", state == "D (disk sleep)", b["frozen"])

        t0 = run.signal(signal.SIGTERM)
        rc = run.wait(GRACE_S + SIGKILL_WAIT_S + 90)
        took = time.monotonic() - t0
    finally:
        run.kill()
    try:
        failed = run.event("state.failed") or {}
        said = json.dumps(failed)
        stuck = run.event("stop.unkillable")
        b["stop"] = {"exit_code": rc, "seconds": round(took, 3), "unkillable": stuck, "failed": failed}
        b["events"] = run.names()
        expect("b", "SIGTERM: exit 22", rc == 22, f"{rc} after {took:.2f} s")
        expect(
            "b",
            f"... after grace + SIGKILL wait ({GRACE_S + SIGKILL_WAIT_S:g} s), not the GPU-release wait",
            GRACE_S + SIGKILL_WAIT_S <= took < GPU_RELEASE_TIMEOUT_S,
            f"{took:.2f} s",
        )
        wants = ["GPU 0 needs a reset or the host a reboot", f"PID {pid} (VLLM::Worker_TP", "state D (disk sleep)"]
        if wchan and wchan != "0":
            wants.append(f"waiting in {wchan}")
        expect(
            "b",
            "the failure names GPU 0, the PID, D (disk sleep), the wait channel",
            all(w in said for w in wants),
            failed.get("reason") or said,
        )
        expect(
            "b",
            "stop.unkillable: pid, state, wchan",
            stuck is not None and (stuck["pid"], stuck["state"], stuck["wchan"]) == (pid, state, wchan or None),
            stuck,
        )
        if probe is not None:
            listed = [p.pid for p in probe.processes(0)]
            b["nvml_after_stop"] = {"used_mib": probe.memory(0).used_mib, "pids": listed}
            expect("b", "NVML still lists the frozen worker on GPU 0", pid in listed, b["nvml_after_stop"])

        t1 = time.monotonic()
        later = subprocess.run(
            [sys.executable, *entry, "--config", str(cfg), "--log-format", "json"],
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_DEADLINE_S + 60,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
        took2 = time.monotonic() - t1
        line = next((x for x in later.stderr.splitlines() if "needs a reset" in x), later.stderr[-600:])
        b["second_start"] = {"exit_code": later.returncode, "seconds": round(took2, 3), "line": line}
        expect(
            "b",
            f"a second start: exit 22 at once (< deadline {PREFLIGHT_DEADLINE_S:g} s) naming GPU 0 and the PID",
            later.returncode == 22
            and took2 < PREFLIGHT_DEADLINE_S
            and "preflight: GPU 0 needs a reset or the host a reboot" in later.stderr
            and f"PID {pid} (VLLM::Worker_TP" in later.stderr,
            f"exit {later.returncode} in {took2:.2f} s: {line[:300]}",
        )
    finally:
        freezer.thaw()
        t2 = time.monotonic()

        def gone() -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        ended = pid is None or wait_for(gone, 60)
        b["thaw"] = {"worker_gone": ended, "gone_s": round(time.monotonic() - t2, 3)}
    expect("b", "thawed, the pending SIGKILL ends the worker", ended, b["thaw"])
    if probe is not None:

        def released() -> bool:
            return pid not in [p.pid for p in probe.processes(0)] and probe.memory(0).used_mib <= (idle_mib or 0) + 200

        back = wait_for(released, 60)
        b["thaw"].update({"gpu_released": bool(back), "released_s": round(time.monotonic() - t2, 3)})
        b["thaw"]["used_mib"] = probe.memory(0).used_mib
        expect("b", "GPU 0's memory is released (NVML)", bool(back), b["thaw"])
        probe.close()


# -- the scene -----------------------------------------------------------------------------------------------


def device() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "kernel": platform.release()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        q = "--query-gpu=name,memory.total,driver_version"
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    busy = sub.add_parser("_busy")
    busy.add_argument("--mib", type=int, required=True)
    busy.add_argument("--ready", required=True)
    busy.add_argument("--fake", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mib", type=int, default=4096, help="MiB the workers hold on GPU 0")
    ap.add_argument("--fake", action="store_true", help="CPU: no torch, no NVML")
    ap.add_argument("--steps", default="cab", help="which steps, in this order (default: cab)")
    ap.add_argument("--pyspy", help="py-spy's path (default: forensics.find_pyspy)")
    args = ap.parse_args(argv)
    if args.cmd == "_busy":
        return busy_main(args)
    if args.out is None:
        ap.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kimi-incident-"))
    res: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "fake": args.fake,
        "mib": args.mib,
        "command": " ".join(sys.argv),
        "device": device(),
    }
    steps = {
        "c": lambda: step_c(res, work, args.fake),
        "a": lambda: step_a(res, work, args.mib, args.fake, args.pyspy),
        "b": lambda: step_b(res, work, args.mib, args.fake),
    }
    try:
        for s in args.steps:
            try:
                steps[s]()
            except Exception as exc:  # the scene reports what it reached, whatever stopped a step
                expect(s, "the step ran to its end", False, f"{type(exc).__name__}: {exc}")
    finally:
        res["checks"] = [{"step": s, "name": n, "ok": ok, "detail": d} for s, n, ok, d in CHECKS]
        (args.out / "gpu_incident.json").write_text(json.dumps(res, indent=1, default=str))
        rows = [[s, n, "SKIP" if ok is None else "PASS" if ok else "FAIL", d[:240]] for s, n, ok, d in CHECKS]
        table = md_table(["step", "check", "result", "detail"], rows)
        (args.out / "gpu_incident.md").write_text(f"# gpu_incident.py, {res['date_utc']}\n\n{table}\n")
        print(table, flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(ok is not False for _, _, ok, _ in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
