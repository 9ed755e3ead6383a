#!/usr/bin/env python3
"""GPU pinning (docs/configuration.md) on real GPUs: `preflight.gpus = [N]` gives a child that sees that one device.

    python3 gpuaccept/gpu_pinning.py --out DIR [--mib 1024]

For N = 0 (and, with 2+ GPUs, also the last index, where an unpinned child would see GPU 0 instead): the real
CLI with real NVML supervises gpuaccept/gpu_child.py with `--tensor-parallel-size 1`; once READY, its worker
reports what CUDA shows it (gpu_child.cuda_view).  Checked:
  - the worker's environment (/proc/PID/environ): CUDA_VISIBLE_DEVICES = N, CUDA_DEVICE_ORDER = PCI_BUS_ID,
    NCCL_RAS_ADDR = 127.0.0.1:(28100 + 2N);
  - torch.cuda.device_count() == 1;
  - device 0's PCI bus id, from torch and from the driver API, equals NVML's and nvidia-smi's for index N;
  - the dry run's JSON beside it shows the same child_env;
  - SIGTERM: exit 0.
Also recorded: whether NVML's index order is ascending PCI bus id order (what makes an NVML index and
CUDA_DEVICE_ORDER=PCI_BUS_ID name the same device).  Writes DIR/gpu_pinning.json and DIR/gpu_pinning.md;
exit 0 when every check passed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaccept.gpu_tier.common import gpu_child_section, scene_start, write_gpu_config  # noqa: E402
from gpuaccept.gpu_two_supervisors import CHECKS, Supervisor, expect  # noqa: E402
from testkit.procutil import free_port  # noqa: E402

RAS_BASE_PORT = 28100  # kimi_supervisor/config/gpu_pinning.py


def bus_key(bus_id: str) -> tuple[int, int, int, int]:
    """A PCI bus id in any of NVML's ("00000000:18:00.0") or CUDA's ("0000:18:00.0") spellings, comparable."""
    domain, bus, rest = bus_id.strip().lower().split(":")
    device, _, function = rest.partition(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function or "0", 16)


def nvml_bus_ids() -> list[str]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).busId
            out.append(bus.decode() if isinstance(bus, bytes) else str(bus))
        return out
    finally:
        pynvml.nvmlShutdown()


def smi_bus_ids() -> dict[int, str]:
    text = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout
    return {int(i): b.strip() for i, _, b in (line.partition(",") for line in text.splitlines() if "," in line)}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def worker_pid(supervisor_pid: int) -> int | None:
    """The worker (comm VLLM::Worker_TP0) below the supervisor's child."""
    import psutil

    for p in psutil.Process(supervisor_pid).children(recursive=True):
        if p.name().startswith("VLLM::Worker"):
            return p.pid
    return None


def scene(gpu: int, work: Path, env: dict[str, str], mib: int, nvml: list[str], smi: dict[int, str]) -> dict[str, Any]:
    port = free_port()
    child_dir = work / f"child{gpu}"
    cfg = work / f"pin{gpu}.toml"
    (work / "shm").mkdir(exist_ok=True)
    paths = ["[paths]", f"runtime_directory = {json.dumps(str(work / 'run'))}"]
    paths.append(f"state_directory = {json.dumps(str(work / 'state'))}")
    child = gpu_child_section(port, 1, mib, str(child_dir), NCCL_CUMEM_HOST_ENABLE="0")
    write_gpu_config(cfg, child, str(work / "shm"), [f"gpus = [{gpu}]", "deadline_s = 30"], paths)
    label = f"gpus = [{gpu}]"
    out: dict[str, Any] = {"gpu": gpu, "nvml_bus_id": nvml[gpu], "smi_bus_id": smi.get(gpu)}
    sup = Supervisor(cfg, env)
    out["command"] = " ".join(sup.cmd)
    try:
        sup.wait_event("state.ready", 240)
        view = json.loads((child_dir / "worker0.ready").read_text())
        out["worker"] = view
        pid = worker_pid(sup.proc.pid)
        wenv = environ_of(pid) if pid else {}
        out["worker_env"] = {k: wenv.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_RAS_ADDR")}
        want = {
            "CUDA_VISIBLE_DEVICES": str(gpu),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "NCCL_RAS_ADDR": f"127.0.0.1:{RAS_BASE_PORT + 2 * gpu}",
        }
        expect(f"{label}: the worker's /proc environ pins GPU {gpu}", out["worker_env"] == want, json.dumps(wenv))
        expect(
            f"{label}: torch.cuda.device_count() == 1",
            view.get("torch_device_count") == 1,
            str(view.get("torch_device_count")),
        )
        for source in ("torch_pci_bus_id", "cuda_pci_bus_id"):
            seen = view.get(source)
            same = seen is not None and bus_key(seen) == bus_key(nvml[gpu])
            expect(f"{label}: device 0's {source} is NVML index {gpu}'s", same, f"{seen} vs NVML {nvml[gpu]}")
        expect(
            f"{label}: nvidia-smi's bus id for index {gpu} is NVML's",
            gpu in smi and bus_key(smi[gpu]) == bus_key(nvml[gpu]),
            f"{smi.get(gpu)} vs {nvml[gpu]}",
        )
        dry = subprocess.run(
            [*sup.cmd[:5], "--dry-run", "--json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
        )
        child_env = json.loads(dry.stdout).get("child_env", {}) if dry.stdout.strip() else {}
        out["dry_run_child_env"] = child_env
        expect(
            f"{label}: the dry run's child_env shows the pinning",
            {k: child_env.get(k) for k in want} == want,
            json.dumps(child_env),
        )
    finally:
        if sup.proc.poll() is None:
            sup.proc.send_signal(signal.SIGTERM)
        rc, took = sup.finish(120)
        out["exit"] = rc
        out["stop_s"] = round(took, 2)
    expect(f"{label}: SIGTERM ends the supervisor with exit 0", rc == 0, f"exit {rc}")
    return out


def render_md(result: dict[str, Any]) -> str:
    lines = ["# GPU pinning on real GPUs (issue 33)", "", f"GPUs: {result['gpus']}", ""]
    lines += [f"NVML index order is PCI bus order: {result['nvml_index_order_is_pci_order']}", ""]
    lines += ["| index | NVML bus id | nvidia-smi bus id |", "|---|---|---|"]
    lines += [f"| {i} | {b} | {result['smi'].get(i, '-')} |" for i, b in enumerate(result["nvml"])]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {d.replace('|', '/')[:200]} |" for n, ok, d in result["checks"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    args, work, env = scene_start("kimi-pin-", 1024, __doc__)
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):  # the supervisor's, not the shell's, must win
        env.pop(name, None)
    nvml, smi = nvml_bus_ids(), smi_bus_ids()
    keys = [bus_key(b) for b in nvml]
    result: dict[str, Any] = {"gpus": len(nvml), "nvml": nvml, "smi": smi, "started": time.time()}
    result["nvml_index_order_is_pci_order"] = keys == sorted(keys)
    expect("NVML's index order is ascending PCI bus id order", keys == sorted(keys), json.dumps(nvml))
    targets = [0] + ([len(nvml) - 1] if len(nvml) >= 2 else [])
    result["scenes"] = [scene(g, work, env, args.mib, nvml, smi) for g in targets]
    result["checks"] = CHECKS
    (args.out / "gpu_pinning.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "gpu_pinning.md").write_text(render_md(result))
    failed = [n for n, ok, _ in CHECKS if not ok]
    print(f"{len(CHECKS) - len(failed)}/{len(CHECKS)} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
