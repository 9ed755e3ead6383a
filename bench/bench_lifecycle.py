"""Rows 2, 3, 5, 10 and 11: READY=1 latency, stop time, idle cost, a crash's exit, a start's spawn; the real CLI
under testkit.harness.Run.  Row 3 also has what an incident's capture adds to a stop (a hanging py-spy and a
silent NCCL RAS service, in process), the number tests/opsview/test_ncclras.py leaves to it.

Rows 10 and 11 side by side with another checkout of the supervisor (the same fake vLLM, runs interleaved):

    python3 -m bench.bench_lifecycle crash /work/main
    python3 -m bench.bench_lifecycle spawn /work/main
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import Row, median, ms, ready_lags, spread, table
from kimi_supervisor.opsview import forensics
from testkit.checkout_start import bare_start, checkout_entry, spawn_times
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import Run, fake_config, fake_tree_of

READY_RUNS = 10
STOP_RUNS = 5
CRASH_RUNS = 8
CAPTURE_RUNS = 3
CAPTURE_BUDGET_S = 1.0
SPAWN_RUNS = 8
IDLE_WINDOW_S = 30.0


def ready_rows() -> list[Row]:
    rng = random.Random(7)
    rows = []
    for poll_s in (0.25, 0.05):
        lat = ready_lags(READY_RUNS, poll_s, rng, lambda t: t.first_200)
        never_before = min(lat) >= 0
        rows.append(
            Row(
                f"2. READY=1 after first /health 200, poll {poll_s:g} s ({READY_RUNS} runs)",
                "<= 100 ms, never before",
                spread(lat),
                never_before and max(lat) <= 0.100,
            )
        )
    return rows


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop_once(tmp: Path, ignore_sigterm: bool, grace_s: float) -> tuple[float, float, int, int, int]:
    """Seconds from SIGTERM to the tree gone and to the supervisor's exit, tree size, orphans after exit, rc."""
    fake_args = ["--ignore-sigterm"] if ignore_sigterm else []
    cfg = fake_config(tmp, fake_args, tp=8, shutdown={"grace_s": grace_s})
    run = Run(cfg, tmp)
    try:
        run.wait_event("state.ready", timeout=60)
        tree = fake_tree_of(str(tmp))  # after ready the tree is complete: main, EngineCore, 8 workers
        t0 = run.signal()
        while not all(_gone(p) for p in tree):
            if time.monotonic() - t0 > grace_s + 10:
                break
            time.sleep(0.005)
        took = time.monotonic() - t0
        run.proc.wait(timeout=30)
        exited = time.monotonic() - t0
        rc = run.wait(timeout=30)
        return took, exited, len(tree), len(fake_tree_of(str(tmp))), rc
    finally:
        run.kill()


def stop_rows() -> list[Row]:
    rows = []
    for label, ignore, grace in (("normal", False, 3.0), ("--ignore-sigterm", True, 2.0)):
        results = []
        for _ in range(STOP_RUNS):
            with tempfile.TemporaryDirectory(prefix="kimi-bench-stop-") as tmp:
                results.append(_stop_once(Path(tmp), ignore, grace))
        took = [r[0] for r in results]
        exited = [r[1] for r in results]
        orphans = sum(r[3] for r in results)
        rcs = sorted({r[4] for r in results})
        rows.append(
            Row(
                f"3. stop, fake vLLM -tp 8, {label}, grace {grace:g} s ({STOP_RUNS} runs)",
                f"<= {grace + 1:g} s, 0 orphans",
                f"tree gone: median {median(took):.2f} s, max {max(took):.2f} s ({results[0][2]} procs); "
                f"supervisor exit: max {max(exited):.2f} s; orphans {orphans}; exit {rcs}",
                max(took) <= grace + 1 and orphans == 0,
            )
        )
    return rows + capture_rows()


class _HangingDumper:
    """py-spy stuck on one process (D state): answers for PID 1 at once, never for PID 2 until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]:
        if pid == 2:
            self.release.wait(60)
        return f"Thread {pid}", None


def capture_rows() -> list[Row]:
    """The capture's delay to a stop when one dump hangs and the RAS service accepts but never answers: in parallel
    the budget, one after the other the budget plus the RAS bound."""
    bound = min(forensics.RAS_S, forensics.RAS_SHARE * CAPTURE_BUDGET_S)
    took = []
    for _ in range(CAPTURE_RUNS):
        dumper = _HangingDumper()
        clock = FakeClock()
        with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody ever reads or answers
            scene = forensics.Scene(
                "bench",
                17,
                [(1, "api"), (2, "EngineCore")],
                FakeGpuProbe([FakeGpu()]),
                (0,),
                None,
                ("127.0.0.1", silent.getsockname()[1]),
            )
            try:
                incident = forensics.capture(
                    scene,
                    dumper,
                    "",
                    clock=clock.monotonic,
                    wall=clock.time,
                    log=RecordingLog(),
                    budget_s=CAPTURE_BUDGET_S,
                )
            finally:
                dumper.release.set()
        took.append(incident.seconds)
    return [
        Row(
            f"3. incident capture, a dump hanging, RAS silent, budget {CAPTURE_BUDGET_S:g} s ({CAPTURE_RUNS} runs)",
            f"< {CAPTURE_BUDGET_S + bound:g} s (the budget plus the RAS bound: one after the other)",
            spread(took),
            max(took) < CAPTURE_BUDGET_S + bound,
        )
    ]


def _sched_ns(pid: int) -> int:
    """CPU time of every thread of `pid` in ns (/proc/PID/task/*/schedstat: exact, not in clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[0])
    return total


def idle_rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="kimi-bench-idle-") as tmp_name:
        tmp = Path(tmp_name)
        sections: dict[str, Any] = {"health": {"interval_s": 5}}
        run = Run(fake_config(tmp, **sections), tmp)
        try:
            run.wait_event("state.ready", timeout=60)
            time.sleep(2)  # let the post-ready work settle
            sup = psutil.Process(run.proc.pid)
            c0, s0, t0 = sup.cpu_times(), _sched_ns(sup.pid), time.monotonic()
            time.sleep(IDLE_WINDOW_S)
            c1, s1, t1 = sup.cpu_times(), _sched_ns(sup.pid), time.monotonic()
            rss = sup.memory_info().rss
            probes = sum(1 for line in run.child_lines if "/health" in str(line.get("line", "")))
            run.signal()
            run.wait(timeout=30)
        finally:
            run.kill()
    cpu = max(0.0, c1.user + c1.system - c0.user - c0.system) / (t1 - t0)
    sched = (s1 - s0) / 1e9 / (t1 - t0)
    return [
        Row("5. idle RSS of the supervisor, health every 5 s", "<= 60 MB", f"{rss / 1e6:.1f} MB", rss <= 60e6),
        Row(
            f"5. idle CPU of the supervisor over {IDLE_WINDOW_S:g} s",
            "<= 0.5% of a core",
            f"{cpu * 100:.3f}% (psutil), {sched * 100:.3f}% (schedstat); {probes} /health lines in the run",
            max(cpu, sched) <= 0.005,
        ),
    ]


def _crash_once(tmp: Path, tree: Path | None, after_ready_s: float) -> tuple[float, int]:
    """Seconds from SIGKILL to vLLM's main (its workers live on, holding the pipes: --orphan-workers) to the
    supervisor's exit, and its exit status.  /health every 5 s: no probe result hurries the notice."""
    run = Run(fake_config(tmp, ["--orphan-workers"], health={"interval_s": 5}), tmp, entry=checkout_entry(tree))
    try:
        run.wait_event("state.ready", timeout=60)
        time.sleep(after_ready_s)  # a random phase against the loop's own wake-ups
        t0 = time.monotonic()
        os.kill(run.child_pid, signal.SIGKILL)
        run.proc.wait(timeout=30)
        took = time.monotonic() - t0
        return took, run.wait(timeout=30)
    finally:
        run.kill()


def crash_rows(trees: tuple[Path | None, ...] = (None,)) -> list[Row]:
    rng = random.Random(10)
    took: dict[Path | None, list[float]] = {t: [] for t in trees}
    codes: dict[Path | None, set[int]] = {t: set() for t in trees}
    for _ in range(CRASH_RUNS):
        for tree in trees:  # interleaved: a busy moment of the machine hits both alike
            with tempfile.TemporaryDirectory(prefix="kimi-bench-crash-") as tmp:
                seconds, rc = _crash_once(Path(tmp), tree, rng.uniform(0.0, 1.0))
            took[tree].append(seconds)
            codes[tree].add(rc)
    bare = bare_start()
    rows = []
    for tree in trees:
        label = "" if tree is None else f" [{tree}]"
        rows.append(
            Row(
                f"10. crash -> supervisor exit, fake vLLM main SIGKILLed after READY ({CRASH_RUNS} runs){label}",
                "<= 300 ms, exit 13",
                f"{spread(took[tree])}; exit {sorted(codes[tree])}; bare `python3 -c pass`: {ms(bare)}",
                max(took[tree]) <= 0.300 and codes[tree] == {13},
            )
        )
    return rows


def spawn_rows(trees: tuple[Path | None, ...] = (None,), compile_first: bool = True) -> list[Row]:
    """`compile_first=False`: the trees as they are (gpuaccept/gpu_incident.py compares one without bytecode)."""
    took = spawn_times(trees, SPAWN_RUNS, compile_first)
    bare = bare_start()
    return [
        Row(
            f"11. supervisor start -> spawn, fake vLLM, process create times"
            f"{', bytecode compiled' if compile_first else ''} ({SPAWN_RUNS} runs)"
            + ("" if tree is None else f" [{tree}]"),
            "<= 300 ms",
            f"{spread(took[tree])}; bare `python3 -c pass`: {ms(bare)}",
            median(took[tree]) <= 0.300,
        )
        for tree in trees
    ]


if __name__ == "__main__":
    rows = {"crash": crash_rows, "spawn": spawn_rows}
    if sys.argv[1:2] not in (["crash"], ["spawn"]):
        sys.exit("usage: python3 -m bench.bench_lifecycle crash|spawn [OTHER_CHECKOUT ...]")
    print(table(rows[sys.argv[1]]((None, *(Path(t) for t in sys.argv[2:])))))
