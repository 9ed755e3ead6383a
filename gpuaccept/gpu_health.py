#!/usr/bin/env python3
"""GPU health on real NVML: every field the preflight reads, XID event registration, a real XID.

    python3 gpuaccept/gpu_health.py --out DIR [--no-fault]

Writes DIR/gpu_health.json and DIR/gpu_health.md and prints a readable summary.

  a. Per GPU: `NvmlProbe.health()` (every field, with the time it takes), the
     preflight's six checks over it, nvidia-smi's view of the same counters.
  b. `NvmlProbe.watch_events()`: which event kinds NVML accepts per GPU; a wait
     with no event returns after its timeout.
  c. A real XID: a process of ours runs a CUDA kernel that stores to an
     unmapped address (an MMU fault in our own context: the driver reports an
     XID and tears down that context; nothing is reset, no other process is
     touched).  Is it delivered to the watch, with which number, how soon?
  d. The Supervisor (in-process, as the CLI builds it, over NvmlProbe)
     supervising testkit/fakes/fake_vllm.py on GPU 0; the same fault in a
     stranger's process beside it (uid `--stranger-uid`, default 65534, nobody):
     XID 31 is application-scoped, so it must be logged (`gpu.xid_application`)
     while the tree keeps its PIDs and the supervisor stays ready; then SIGTERM
     stops it (exit 0).  A device-level XID (exit 18) cannot be made on purpose:
     tests/liveness/test_gpu_events.py covers it with the fake probe.  The dry-run report
     on this host is kept too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimi_supervisor.config.load import parse_config  # noqa: E402
from kimi_supervisor.host.nvml import NvmlProbe  # noqa: E402
from kimi_supervisor.preflight import gpu_health  # noqa: E402

# A store to an address no allocation maps: the MMU faults in our own context only.
FAULT_CODE = r"""
import sys, time
import cupy as cp
k = cp.RawKernel(r'extern "C" __global__ void bad(int *p){ *((volatile int*)0x1000) = *p; }', 'bad')
x = cp.ones(1, dtype=cp.int32)
cp.cuda.runtime.deviceSynchronize()
print("LAUNCH", repr(time.monotonic()), flush=True)
k((1,), (1,), (x,))
try:
    cp.cuda.runtime.deviceSynchronize()
    print("NOFAULT", flush=True)
except Exception as exc:
    print("FAULT", repr(time.monotonic()), type(exc).__name__, str(exc)[:200], flush=True)
"""


def sh(cmd: list[str], timeout: float = 60) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"


def fault(gpu: int, uid: int | None = None) -> dict[str, Any]:
    """The faulting kernel, in a process of ours or (uid) a stranger's."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    if uid is not None:
        env.update(HOME="/tmp", CUPY_CACHE_DIR=f"/tmp/kimi-cupy-{uid}")

    def become() -> None:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", FAULT_CODE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=become if uid is not None else None,
    )
    out: dict[str, Any] = {"rc": r.returncode, "stdout": r.stdout[-800:], "stderr": r.stderr[-1500:]}
    for line in r.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("LAUNCH", "FAULT"):
            out[word.lower() + "_at"] = float(rest.split(" ")[0])
        if word == "FAULT":
            out["error"] = rest.split(" ", 1)[1] if " " in rest else ""
    out["took_s"] = round(time.monotonic() - t0, 3)
    return out


def part_a(probe: NvmlProbe, n: int, res: dict[str, Any]) -> None:
    cfg = parse_config({"child": {"argv": ["vllm", "serve", "/m"]}}, Path("/dev/null"))
    healths = []
    for i in range(n):
        t = time.perf_counter()
        h = probe.health(i)
        took = time.perf_counter() - t
        t = time.perf_counter()
        probe.health(i)
        warm = time.perf_counter() - t
        healths.append(h)
        res["health"].append(
            {**dataclasses.asdict(h), "first_ms": round(took * 1e3, 3), "warm_ms": round(warm * 1e3, 3)}
        )
    res["checks"] = [
        {"name": c.name, "status": c.status.value, "message": c.message}
        for c in gpu_health.evaluate(healths, cfg.gpu_health)
    ]
    res["nvidia_smi_q"] = sh(["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER,PAGE_RETIREMENT,PERFORMANCE"])
    res["nvidia_smi_pcie"] = sh(
        [
            "nvidia-smi",
            "--query-gpu=index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,"
            "persistence_mode,clocks_event_reasons.active",
            "--format=csv",
        ]
    )


def part_bc(probe: NvmlProbe, n: int, res: dict[str, Any], do_fault: bool) -> None:
    import pynvml

    res["supported_event_types"] = {}
    for i in range(n):
        try:
            mask = pynvml.nvmlDeviceGetSupportedEventTypes(pynvml.nvmlDeviceGetHandleByIndex(i))
            res["supported_event_types"][i] = hex(mask)
        except pynvml.NVMLError as exc:
            res["supported_event_types"][i] = str(exc)
    watch = probe.watch_events(tuple(range(n)))
    res["registered"] = {str(k): list(v) for k, v in watch.registered.items()}
    waits = []
    for timeout in (0.1, 0.5):
        t = time.monotonic()
        ev = watch.wait(timeout)
        waits.append({"timeout_s": timeout, "returned_after_s": round(time.monotonic() - t, 4), "event": str(ev)})
    res["idle_waits"] = waits
    if not do_fault:
        watch.close()
        return
    got: list[tuple[float, Any]] = []

    def listen() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end and not got:
            ev = watch.wait(0.25)
            if ev is not None:
                got.append((time.monotonic(), ev))

    th = threading.Thread(target=listen)
    th.start()
    f = fault(0)
    th.join()
    watch.close()
    res["fault_direct"] = f
    if got:
        at, ev = got[0]
        res["event_direct"] = dataclasses.asdict(ev)
        if "fault_at" in f:
            res["event_after_fault_ms"] = round((at - f["fault_at"]) * 1e3, 1)
        if "launch_at" in f:
            res["event_after_launch_ms"] = round((at - f["launch_at"]) * 1e3, 1)
    else:
        res["event_direct"] = None
    res["dmesg_xid"] = sh(["sh", "-c", "dmesg 2>&1 | grep -i xid | tail -5"])


class TimedLog:
    """A structlog stand-in that records (monotonic time, level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[float, str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        if level not in ("debug", "info", "warning", "error", "critical", "exception"):
            raise AttributeError(level)

        def emit(event: str, **fields: Any) -> None:
            self.records.append((time.monotonic(), level, event, fields))

        return emit

    def first(self, event: str) -> tuple[float, str, str, dict[str, Any]] | None:
        return next((r for r in list(self.records) if r[2] == event), None)


def part_d(res: dict[str, Any], do_fault: bool, stranger_uid: int = 65534) -> None:
    """The Supervisor itself (in-process: this machine has no structlog wheel) over real NVML."""
    import importlib
    import types

    res["stubbed_modules"] = []
    for name in ("structlog", "sdnotify"):  # imported at module level, used only by the CLI's logging setup
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            res["stubbed_modules"].append(name)
    from kimi_supervisor.clock import SystemClock
    from kimi_supervisor.config.load import load_config
    from kimi_supervisor.exitcodes import SupervisorError
    from kimi_supervisor.host.proctable import PsutilProcessTable
    from kimi_supervisor.lifecycle.deps import Deps
    from kimi_supervisor.lifecycle.supervisor import Supervisor
    from kimi_supervisor.logs.journal import ConsoleChildSink
    from kimi_supervisor.preflight.report import render_text
    from kimi_supervisor.preflight.run import Preflight
    from kimi_supervisor.states import State
    from kimi_supervisor.systemd.notify import NullNotifier
    from testkit.harness import fake_config, fake_tree_of

    with tempfile.TemporaryDirectory(prefix="kimi-gpu-health-") as name:
        tmp = Path(name)
        path = fake_config(
            tmp,
            [],
            tp=1,
            preflight={"gpus": [0], "check_model": False},
            shutdown={"grace_s": 3, "gpu_release_timeout_s": 0},
            liveness={"canary_interval_s": 0, "stuck_after_s": 0},
        )
        cfg = load_config(path)
        probe = NvmlProbe()
        log = TimedLog()
        report = Preflight(cfg, probe, PsutilProcessTable(), SystemClock(), log).run(dry_run=True)
        res["dry_run"] = {"stdout": render_text(report, str(path)), "proceed": report.proceed}
        if not do_fault:
            return
        devnull = open(os.devnull, "w")  # noqa: SIM115
        sup = Supervisor(cfg, Deps(probe, PsutilProcessTable(), NullNotifier(), log, ConsoleChildSink(devnull)))

        def trigger() -> None:
            end = time.monotonic() + 60
            while time.monotonic() < end and not (sup.state.state is State.READY and log.first("gpu.events_watching")):
                time.sleep(0.05)
            tree = {p.pid: p.create_time() for p in fake_tree_of(str(tmp))}
            res["supervisor_fault"] = fault(0, stranger_uid)
            end = time.monotonic() + 5
            while time.monotonic() < end and not log.first("gpu.xid_application"):
                time.sleep(0.05)
            time.sleep(1.0)  # a verdict, were there one, came within 136 ms in earlier versions
            res["stranger_xid_logged"] = log.first("gpu.xid_application") is not None
            res["tree_untouched_after_stranger_xid"] = bool(tree) and tree == {
                p.pid: p.create_time() for p in fake_tree_of(str(tmp))
            }
            res["state_after_stranger_xid"] = sup.state.state.value
            os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's own handler: a requested stop, exit 0

        th = threading.Thread(target=trigger)
        th.start()
        try:
            rc = int(sup.run())
        except SupervisorError as exc:
            rc = int(exc.exit_code)
            res["supervisor_error"] = exc.message
        exited = time.monotonic()
        th.join()
        probe.close()
        res["supervisor_rc"] = rc
        watching = log.first("gpu.events_watching")
        res["supervisor_watching"] = watching[3] if watching else None
        res["supervisor_events"] = [
            {"t": round(t, 3), "level": lvl, "event": ev, **{k: str(v) for k, v in f.items()}}
            for t, lvl, ev, f in log.records
            if ev.startswith(("gpu.", "state.", "stop.", "liveness."))
        ]
        f = res["supervisor_fault"]
        xid = log.first("gpu.xid") or log.first("gpu.xid_application")
        for key in ("launch_at", "fault_at"):
            if key in f:
                res[f"supervisor_exit_after_{key[:-3]}_ms"] = round((exited - f[key]) * 1e3, 1)
                if xid:
                    res[f"supervisor_xid_logged_after_{key[:-3]}_ms"] = round((xid[0] - f[key]) * 1e3, 1)
        if xid:
            res["supervisor_exit_after_xid_logged_ms"] = round((exited - xid[0]) * 1e3, 1)


def render(res: dict[str, Any]) -> str:
    out = ["# kimi-supervisor GPU health on real NVML", ""]
    out.append(f"- {res['host']}")
    out.append("")
    out.append("## Health fields (NvmlProbe.health)")
    out.append("")
    out.append("```json")
    out.append(json.dumps(res["health"], indent=1))
    out.append("```")
    out.append("")
    out.append("## Preflight checks over them (default policy)")
    out.append("")
    for c in res.get("checks", []):
        out.append(f"- `[{c['status']}] {c['name']}`: {c['message']}")
    out.append("")
    for key in (
        "supported_event_types",
        "registered",
        "idle_waits",
        "fault_direct",
        "event_direct",
        "event_after_fault_ms",
        "event_after_launch_ms",
        "dmesg_xid",
        "supervisor_watching",
        "supervisor_fault",
        "supervisor_rc",
        "supervisor_error",
        "stranger_xid_logged",
        "tree_untouched_after_stranger_xid",
        "state_after_stranger_xid",
        "supervisor_exit_after_launch_ms",
        "supervisor_exit_after_fault_ms",
        "supervisor_xid_logged_after_launch_ms",
        "supervisor_xid_logged_after_fault_ms",
        "supervisor_exit_after_xid_logged_ms",
        "stubbed_modules",
        "supervisor_events",
        "errors",
    ):
        if key in res:
            out.append(f"## {key}")
            out.append("")
            out.append("```")
            value = res[key]
            out.append(value if isinstance(value, str) else json.dumps(value, indent=1))
            out.append("```")
            out.append("")
    if "dry_run" in res:
        out += ["## Dry run on this host (Preflight.run(dry_run=True), report.render_text)", "", "```"]
        out += [res["dry_run"]["stdout"].rstrip(), "```", ""]
    out += [
        "## nvidia-smi (cross-check)",
        "",
        "```",
        res.get("nvidia_smi_pcie", ""),
        "",
        res.get("nvidia_smi_q", ""),
        "```",
    ]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-fault", action="store_true", help="skip the parts that make a real XID")
    p.add_argument("--stranger-uid", type=int, default=65534, help="part d: the uid whose kernel faults")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    import pynvml

    probe = NvmlProbe()
    n = probe.device_count()
    res: dict[str, Any] = {"health": [], "errors": []}
    res["host"] = (
        f"GPUs: {n} x {pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))}; "
        f"driver {pynvml.nvmlSystemGetDriverVersion()}; NVML {pynvml.nvmlSystemGetNVMLVersion()}; "
        f"python {platform.python_version()}; kernel {platform.release()}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
    )
    for name, step in (
        ("a", lambda: part_a(probe, n, res)),
        ("bc", lambda: part_bc(probe, n, res, not a.no_fault)),
        ("d", lambda: part_d(res, not a.no_fault, a.stranger_uid)),
    ):
        try:
            step()
        except Exception:
            res["errors"].append(f"part {name}: {traceback.format_exc()[-2000:]}")
    probe.close()
    (a.out / "gpu_health.json").write_text(json.dumps(res, indent=1, default=str))
    text = render(res)
    (a.out / "gpu_health.md").write_text(text)
    summary = {
        k: res.get(k)
        for k in (
            "registered",
            "event_direct",
            "event_after_fault_ms",
            "supervisor_rc",
            "supervisor_error",
            "stranger_xid_logged",
            "tree_untouched_after_stranger_xid",
            "state_after_stranger_xid",
            "supervisor_exit_after_launch_ms",
            "supervisor_exit_after_fault_ms",
            "supervisor_exit_after_xid_logged_ms",
            "errors",
        )
    }
    print("\n".join(f"[{c['status']}] {c['name']}: {c['message']}" for c in res.get("checks", [])))
    print(json.dumps(summary, indent=1, default=str))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
