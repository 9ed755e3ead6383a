#!/usr/bin/env python3
"""Instance locks (docs/kill-safety.md) on real GPUs: a second kimi-supervisor beside a serving one changes nothing.

    python3 gpuaccept/gpu_two_supervisors.py --out DIR [--mib 4096]

A (the real CLI, real NVML) supervises gpuaccept/gpu_child.py: one torch worker per
GPU (comm VLLM::Worker_TP<i>, which matches the kill rules), NCCL group, MIB MiB
each.  Once A is READY:
  1. `--dry-run --json` with A's config: exit 16, names A, would kill nothing;
  2. B = the same command again: exit 16 at once, one line naming A;
  3. B' = the same config but another paths.runtime_directory (so the lock is not
     shared: the belt-and-braces case): its preflight must not signal A's
     workers (they descend from a live kimi-supervisor) and fails with exit 10
     after preflight.deadline_s, naming them;
  after each: A's tree (PID + create time) unchanged, NVML still lists the
  workers with the same MiB, A still answers /health.  Then SIGTERM A: exit 0.
Writes DIR/two_supervisors.json and DIR/two_supervisors.md.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpuaccept.gpu_tier.common import gpu_child_section, scene_start, write_gpu_config  # noqa: E402 - needs the repo on sys.path

CHECKS: list[tuple[str, bool, str]] = []


def expect(name: str, ok: bool, detail: str = "") -> None:
    CHECKS.append((name, bool(ok), detail))
    print(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)


def nvml_state() -> dict[int, dict[str, Any]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            used = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used // (1 << 20)
            out[i] = {
                "used_mib": int(used),
                "procs": {int(p.pid): int(p.usedGpuMemory or 0) // (1 << 20) for p in procs},
            }
        return out
    finally:
        pynvml.nvmlShutdown()


def tree(pid: int) -> dict[int, tuple[str, float]]:
    import psutil

    root = psutil.Process(pid)
    return {p.pid: (p.name(), p.create_time()) for p in [root, *root.children(recursive=True)]}


class Supervisor:
    def __init__(self, config: Path, env: dict[str, str], *extra: str) -> None:
        self.cmd = [sys.executable, "-m", "kimi_supervisor", "--config", str(config), "--log-format", "json", *extra]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        self.events: list[dict[str, Any]] = []
        self.stdout: list[str] = []
        self.threads = [
            threading.Thread(target=self._read, args=(self.proc.stderr, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stdout, False), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read(self, stream: Any, events: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if events:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    self.events.append({"raw": line})
            else:
                self.stdout.append(line)

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e.get("event") == name:
                    return e
            if self.proc.poll() is not None:
                time.sleep(0.3)
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {name}: rc={self.proc.poll()} events={[e.get('event') for e in self.events][-20:]}")

    def finish(self, timeout: float) -> tuple[int, float]:
        rc = self.proc.wait(timeout)
        took = time.monotonic() - self.t0
        for t in self.threads:
            t.join(5)
        return rc, took


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return int(r.status)
    except Exception:  # any failure is "not 200"
        return 0


def write_config(path: Path, port: int, run_dir: Path, shm: Path, mib: int, ngpu: int, child_dir: Path) -> None:
    child = gpu_child_section(port, ngpu, mib, str(child_dir), NCCL_CUMEM_HOST_ENABLE="0")
    paths = ["[paths]", f"runtime_directory = {json.dumps(str(run_dir))}"]
    write_gpu_config(path, child, str(shm), ["deadline_s = 5", "poll_interval_s = 0.1"], paths)


def unchanged(label: str, a: Supervisor, before: dict[int, tuple[str, float]], nv: dict[int, Any], port: int) -> None:
    after = tree(a.proc.pid)
    expect(f"{label}: A's tree unchanged (PID + create time)", after == before, f"{len(after)} processes")
    now = nvml_state()
    same = all(now[i]["procs"] == nv[i]["procs"] for i in nv)
    expect(f"{label}: NVML lists the same workers with the same MiB", same, json.dumps(now))
    expect(f"{label}: A still answers /health 200", a.proc.poll() is None and health(port) == 200)
    expect(
        f"{label}: A logged no kill and no state change",
        not [e for e in a.events if e.get("event") in ("preflight.kill", "state.stopping", "state.failed")],
    )


def main() -> int:
    args, work, env = scene_start("kimi-two-", 4096)
    ngpu = len(nvml_state())
    port = int(
        subprocess.check_output(
            [
                sys.executable,
                "-c",
                "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])",
            ]
        )
    )
    (work / "shm").mkdir()
    cfg, cfg_other = work / "kimi.toml", work / "kimi-other-rundir.toml"
    write_config(cfg, port, work / "run", work / "shm", args.mib, ngpu, work / "child")
    write_config(cfg_other, port, work / "run-other", work / "shm", args.mib, ngpu, work / "child2")
    result: dict[str, Any] = {"gpus": ngpu, "mib": args.mib, "config": cfg.read_text().splitlines()}
    a = Supervisor(cfg, env)
    result["command_a"] = " ".join(a.cmd)
    try:
        ready = a.wait_event("state.ready", 240)
        result["a_ready_s"] = ready.get("startup_s")
        before = tree(a.proc.pid)
        nv = nvml_state()
        workers = [pid for pid, (name, _) in before.items() if name.startswith("VLLM::Worker")]
        held = {i: nv[i]["procs"] for i in nv}
        result["a"] = {"pid": a.proc.pid, "tree": {str(k): v[0] for k, v in before.items()}, "nvml": nv}
        expect(
            "A READY with one worker per GPU holding memory",
            len(workers) == ngpu and all(held.values()),
            json.dumps(held),
        )

        # 1. The dry run beside A.
        t = time.monotonic()
        dry = subprocess.run(
            [*a.cmd[:5], "--dry-run", "--json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
        )
        dry_s = time.monotonic() - t
        report = json.loads(dry.stdout)
        inst = next((c for c in report["checks"] if c["name"] == "instance"), {})
        kills = [c for c in report["checks"] if c["status"] == "would kill"]
        result["dry_run"] = {"rc": dry.returncode, "seconds": round(dry_s, 3), "checks": report["checks"]}
        expect("dry run exits 16", dry.returncode == 16, f"{dry_s * 1000:.0f} ms")
        expect(
            "dry run names A and says a start would refuse",
            f"(PID {a.proc.pid})" in inst.get("message", "") and "would refuse" in inst.get("message", ""),
            inst.get("message", ""),
        )
        expect("dry run would kill nothing", not kills)
        unchanged("after the dry run", a, before, nv, port)

        # 2. The same command again.
        b = Supervisor(cfg, env)
        rc, took = b.finish(60)
        exit_event = next((e for e in b.events if e.get("event") == "supervisor.exit"), {})
        result["second"] = {"rc": rc, "seconds": round(took, 3), "events": b.events}
        expect("second supervisor exits 16", rc == 16, f"{took * 1000:.0f} ms")
        expect("second supervisor refuses in < 1 s", took < 1.0, f"{took * 1000:.0f} ms")
        expect(
            "its one line names A",
            str(exit_event.get("error", "")).startswith(f"another kimi-supervisor (PID {a.proc.pid})"),
            str(exit_event.get("error")),
        )
        expect("it logged nothing else", [e.get("event") for e in b.events] == ["supervisor.exit"])
        unchanged("after the second supervisor", a, before, nv, port)

        # 3. Belt and braces: a supervisor that does not share A's lock directory.
        c = Supervisor(cfg_other, env)
        rc, took = c.finish(120)
        exit_event = next((e for e in c.events if e.get("event") == "supervisor.exit"), {})
        result["other_rundir"] = {"rc": rc, "seconds": round(took, 3), "events": c.events}
        error = str(exit_event.get("error", ""))
        expect("supervisor without A's lock exits 10 (not 16: it cannot see the lock)", rc == 10, f"{took:.1f} s")
        expect("it signalled nothing", not [e for e in c.events if e.get("event") == "preflight.kill"])
        expect(
            "it names A's workers as part of a live supervisor's tree",
            all(f"PID {w} (VLLM::Worker_TP) " in error for w in workers)
            and f"descends from a live kimi-supervisor (PID {a.proc.pid})" in error,
            error[:600],
        )
        unchanged("after the supervisor without the lock", a, before, nv, port)
    finally:
        t = time.monotonic()
        if a.proc.poll() is None:
            a.proc.send_signal(signal.SIGTERM)
        rc, _ = a.finish(90)
        result["a_stop"] = {"rc": rc, "seconds": round(time.monotonic() - t, 3)}
        expect("A stops on SIGTERM with exit 0", rc == 0)
        time.sleep(0.5)
        free = nvml_state()
        expect("GPUs free after A stopped", all(not free[i]["procs"] for i in free), json.dumps(free))
        result["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in CHECKS]
        result["all_passed"] = all(ok for _, ok, _ in CHECKS)
        (args.out / "two_supervisors.json").write_text(json.dumps(result, indent=2))
        lines = [
            "# Two supervisors on real GPUs (issue 11)",
            "",
            f"- GPUs: {ngpu}; worker memory {args.mib} MiB each; all checks passed: **{result['all_passed']}**",
            "",
            "| check | result | detail |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {n} | {'PASS' if ok else 'FAIL'} | {d[:300].replace('|', '/')} |" for n, ok, d in CHECKS]
        (args.out / "two_supervisors.md").write_text("\n".join(lines) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
