"""The run's context: what it started, what it found, what it expects; config, teardown and the log tee."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuaccept.gpu_tier.common import REPO, child_env, shm_listing
from gpuaccept.gpu_tier.gpus import Gpus, comm
from testkit.procutil import free_port, live


class Tee(io.TextIOBase):
    """Where structlog writes: stderr and a list we keep for the report."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, s: str) -> int:
        sys.stderr.write(s)
        self.lines.extend(x for x in s.splitlines() if x.strip())
        return len(s)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False


@dataclasses.dataclass
class Ctx:
    out: Path
    fake: bool
    mib: int
    reps: int
    ngpu: int
    gpus: Gpus
    probe: Any  # GpuProbe for Preflight
    shm_dir: str
    state: Path
    fake_dir: str | None
    started: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[tuple[str, bool, str]] = dataclasses.field(default_factory=list)
    log_tee: Tee | None = None

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def spawn(self, cmd: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.state / log_name, "wb")
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(), start_new_session=True, cwd=REPO
        )
        self.started.append(p)
        return p


def wait_file(path: Path, timeout: float, watch: list[subprocess.Popen[bytes]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        for p in watch:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.pid} exited with {p.returncode} before {path.name} appeared")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout:g}s")


def log_tail(ctx: Ctx, name: str, n: int = 30) -> str:
    try:
        return "\n".join((ctx.state / name).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def make_config(ctx: Ctx, *, deadline_s: float = 30.0, port: int | None = None, tp: int | None = None) -> Any:
    from kimi_supervisor.config.load import parse_config

    port = port or free_port()
    data = {
        "child": {
            "argv": [
                "python3",
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "/tmp/x",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--tensor-parallel-size",
                str(tp or ctx.ngpu),
            ],
        },
        "preflight": {
            "gpus": list(range(ctx.ngpu)),
            "check_model": False,
            "deadline_s": deadline_s,
            "poll_interval_s": 0.1,
            "busy_log_interval_s": 2.0,
            "reap": {"grace_s": 10.0},
            "shm": {"directory": ctx.shm_dir},
        },
    }
    return parse_config(data, Path("gpu-tier"))


class TimingTable:
    """PsutilProcessTable that records when each signal was sent (delegation, no edits)."""

    def __init__(self) -> None:
        from kimi_supervisor.host.proctable import PsutilProcessTable

        self.inner = PsutilProcessTable()
        self.sent: list[tuple[float, int, str]] = []

    def get(self, pid: int) -> Any:
        return self.inner.get(pid)

    def all(self) -> Any:
        return self.inner.all()

    def descendants(self, pid: int) -> Any:
        return self.inner.descendants(pid)

    def open_paths(self, prefixes: tuple[str, ...]) -> Any:
        return self.inner.open_paths(prefixes)

    def alive(self, proc: Any) -> bool:
        return self.inner.alive(proc)

    def signal(self, proc: Any, sig: signal.Signals) -> bool:
        t = time.monotonic()
        ok = self.inner.signal(proc, sig)
        if ok:
            self.sent.append((t, proc.pid, sig.name))
        return ok


# -- a: NVML facts ---------------------------------------------------------------------


def end_decoys(ctx: Ctx) -> None:
    """The decoys (ours) have done their job; the benchmark wants a clean host."""
    decoys = ctx.result.get("orphans_ctx", {}).get("decoys", {})
    if decoys:
        ctx.expect("decoys alive after every scenario", all(live(p) for p in decoys.values()))
    for p in ctx.started:
        if p.pid in decoys.values() and p.poll() is None:
            p.kill()
            p.wait(10)
    for name in ("psm_test_held", "psm_test_stale"):
        with contextlib.suppress(OSError):
            (Path(ctx.shm_dir) / name).unlink()
    ctx.result["shm_before_bench"] = shm_listing(ctx.shm_dir)


def cleanup(ctx: Ctx) -> None:
    for p in ctx.started:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL) if _own_group(p.pid) else p.kill()
    for p in ctx.started:
        with contextlib.suppress(Exception):
            p.wait(10)
    # Orphaned workers this script started (their parent is gone): recorded PIDs only.
    for w in ctx.result.get("orphans", {}).get("workers", []):
        pid = int(w["pid"])
        if live(pid) and comm(pid) == "VLLM::Worker_TP":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for name in ("psm_test_held", "psm_test_stale"):
        with contextlib.suppress(OSError):
            (Path(ctx.shm_dir) / name).unlink()
    ctx.result["swept_at_exit"] = sweep_marked()


def sweep_marked() -> list[int]:
    """SIGKILL every process that carries this run's marker in its environment (all ours)."""
    marker = f"GPU_TIER_RUN_ID={os.environ.get('GPU_TIER_RUN_ID', '')}".encode()
    if marker.endswith(b"="):
        return []
    killed = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if marker in env and live(int(name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
    return killed


def _own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False
