"""Row 1: preflight wall time on 8 clean (fake) GPUs vs the seeds' nvidia-smi bash loop, and its parts; and the
largest config the loader accepts (1 MiB) parsed, whose time tests/config/test_load_fuzz.py leaves to this row; and
a reap of a victim that dies at SIGTERM beside one that ignores it, whose time tests/preflight/test_reaper.py leaves
to this row."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Row, median, ms, p95
from kimi_supervisor.clock import SystemClock
from kimi_supervisor.config.load import load_config, parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.host.gpu import busy_gpus, gpu_processes, wait_until_free
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight import checks
from kimi_supervisor.preflight.reaper import ReapPlan, Victim, execute_reap, plan_reap
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.preflight.shm import plan_shm
from testkit.configs import largest_config
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.harness import free_port

RUNS = 30
BASH_RUNS = 20
TARGET_S = 0.150
BIG_CONFIG_RUNS = 5
BIG_CONFIG_TARGET_S = 3.0  # one start's config: it must not cost what the preflight saves
REAP_RUNS = 3
REAP_GRACE_S = 0.5
REAP_KILL_WAIT_S = 5.0  # execute_reap's default: a wait that ran to its deadline shows as this much more
SEEDS_LOOP = (
    "for i in $(seq 1 30); do used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits "
    '| sort -n | tail -1); [ "$used" -lt 1000 ] && exit 0; sleep 1; done; exit 1'
)


class NullLog:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _ignore(*args: object) -> None:
    return None


def _config(shm: Path) -> Config:
    data: dict[str, Any] = {
        "child": {"argv": ["vllm", "serve", "/models/kimi", "--port", str(free_port()), "-tp", "8"]},
        "preflight": {"check_model": False, "shm": {"directory": str(shm)}},
    }
    return parse_config(data, Path("bench-preflight.toml"))


def _times(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm-up: imports, psutil caches
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _bash_loop(tmp: Path) -> list[float]:
    bindir = tmp / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n0\\n0\\n0\\n0\\n0\\n0\\n0\\n'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    return _times(lambda: subprocess.run(["bash", "-c", SEEDS_LOOP], env=env, check=True), BASH_RUNS)


def _reap_times(table: PsutilProcessTable) -> list[float]:
    """execute_reap's own `seconds`: one victim that dies at SIGTERM, one that ignores it (SIGKILL after the grace)."""
    out = []
    for _ in range(REAP_RUNS):
        stubborn = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
            for code in ("print(1, flush=True); import time; time.sleep(60)", stubborn)
        ]
        try:
            victims = []
            for p in procs:
                assert p.stdout is not None and p.stdout.readline() == b"1\n"  # up, its handler set
                info = table.get(p.pid)
                assert info is not None
                victims.append(Victim(info, (0,), None, "bench"))
            outcome = execute_reap(ReapPlan(tuple(victims), ()), table, SystemClock(), REAP_GRACE_S, _ignore)
            out.append(outcome.seconds)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return out


def run() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="kimi-bench-pf-") as tmp_name:
        tmp = Path(tmp_name)
        shm = tmp / "shm"
        shm.mkdir()
        cfg = _config(shm)
        probe = FakeGpuProbe([FakeGpu() for _ in range(8)])
        table = PsutilProcessTable()
        clock = SystemClock()
        gpus = tuple(range(8))

        def preflight() -> None:
            Preflight(cfg, probe, table, clock, NullLog()).run(dry_run=False)

        def preflight_stale_shm() -> None:
            (shm / "psm_stale").write_bytes(b"x")  # one stale file: plan_shm scans /proc for its users
            Preflight(cfg, probe, table, clock, NullLog()).run(dry_run=False)

        whole = _times(preflight, RUNS)
        bash = _bash_loop(tmp)
        with_shm = _times(preflight_stale_shm, RUNS)
        vllm = cfg.child.vllm
        parts: dict[str, list[float]] = {
            "GPU memory + occupants, 8 GPUs": _times(
                lambda: (busy_gpus(probe, gpus, 1000), gpu_processes(probe, gpus)), RUNS
            ),
            "plan_reap (ancestors)": _times(lambda: plan_reap([], table, cfg.preflight.reap, os.getpid()), RUNS),
            "wait_until_free": _times(lambda: wait_until_free(probe, gpus, 1000, clock, 30, 1, _ignore, 5), RUNS),
            "plan_shm, empty dir": _times(lambda: plan_shm(cfg.preflight.shm, table), RUNS),
            "/proc scan (open_paths)": _times(lambda: table.open_paths((str(shm) + "/",)), RUNS),
            "check_port": _times(lambda: checks.check_port(vllm.host, vllm.port), RUNS),
        }
        big, _ = largest_config(tmp)
        reap = _reap_times(table)
        big_parse = _times(lambda: load_config(big), BIG_CONFIG_RUNS)
    nproc = sum(name.isdigit() for name in os.listdir("/proc"))
    rows = [
        Row(
            f"1. preflight, 8 clean GPUs ({RUNS} runs)",
            "median < 150 ms",
            f"median {ms(median(whole))}, p95 {ms(p95(whole))}",
            median(whole) < TARGET_S,
        ),
        Row(f"1. seeds' bash loop, fake nvidia-smi ({BASH_RUNS} runs)", "-", f"median {ms(median(bash))}", None),
        Row("1. ratio bash loop / preflight", "-", f"{median(bash) / median(whole):.1f}x", None),
        Row(
            "1. preflight with 1 stale shm file",
            "median < 150 ms",
            f"median {ms(median(with_shm))}, p95 {ms(p95(with_shm))} ({nproc} processes)",
            median(with_shm) < TARGET_S,
        ),
    ]
    rows += [Row(f"1.   part: {name}", "-", f"median {ms(median(t))}", None) for name, t in parts.items()]
    rows.append(
        Row(
            f"1. the largest accepted config (1 MiB, 262k strings) loaded ({BIG_CONFIG_RUNS} runs)",
            f"median < {BIG_CONFIG_TARGET_S:g} s",
            f"median {ms(median(big_parse))}, max {ms(max(big_parse))}",
            median(big_parse) < BIG_CONFIG_TARGET_S,
        )
    )
    rows.append(
        Row(
            f"1. reap: one victim dies at SIGTERM, one ignores it, grace {REAP_GRACE_S:g} s ({REAP_RUNS} runs)",
            f"< {REAP_GRACE_S + REAP_KILL_WAIT_S:g} s (no wait to its deadline)",
            f"median {ms(median(reap))}, max {ms(max(reap))}",
            max(reap) < REAP_GRACE_S + REAP_KILL_WAIT_S,
        )
    )
    return rows
