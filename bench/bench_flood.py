"""Row 4: a log flood never slows vLLM.  The same writer (testkit/flood_child.py, vLLM's stats line, print()
per line, block-buffered or flushed per line as vLLM's logger does) piped into `cat` and as the supervised
child, side by side in one run, 500k and 2M lines; the row is the ratio of the child's own elapsed time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, median
from testkit.fatal_flood import LINES as FATAL_FLOOD_LINES
from testkit.fatal_flood import fatal_after_flood
from testkit.harness import REPO, free_port, write_config

FLOOD_CHILD = Path(__file__).resolve().parent.parent / "testkit" / "flood_child.py"
RUNS = 3
TARGET_RATIO = 1.25
# (lines, flushed, --log-format, flood after READY).  After READY is the case the target is for (a serving
# vLLM must never wait on its logger).  While starting, a line holding one of the tracker's literal words
# is matched against every phase pattern (~40 µs): vLLM's stats line holds three (`Engine`, `cache`,
# `Waiting`) but vLLM prints none before READY, so those rows are information only.
VARIANTS = (
    (500_000, False, "json", True),
    (500_000, True, "json", True),
    (2_000_000, False, "json", True),
    (2_000_000, True, "json", True),
    (500_000, False, "console", False),
    (500_000, True, "console", False),
)


def _child_argv(lines: int, elapsed: Path, flushed: bool, rate: float = 0.0) -> list[str]:
    argv = [sys.executable, str(FLOOD_CHILD), str(lines), str(elapsed), "--rate", str(rate)]
    return [*argv, "--flush"] if flushed else argv


def bare(tmp: Path, lines: int, flushed: bool, rate: float = 0.0) -> float:
    """The writer's elapsed seconds with its stdout piped into `cat` (to /dev/null)."""
    elapsed = tmp / "elapsed-bare"
    writer = subprocess.Popen(_child_argv(lines, elapsed, flushed, rate), stdout=subprocess.PIPE)
    assert writer.stdout is not None
    cat = subprocess.Popen(["cat"], stdin=writer.stdout, stdout=subprocess.DEVNULL)
    writer.stdout.close()
    assert writer.wait() == 0 and cat.wait() == 0
    return float(elapsed.read_text())


def supervised(
    tmp: Path, lines: int, flushed: bool, fmt: str, after_ready: bool, rate: float = 0.0
) -> tuple[float, float]:
    """(the child's elapsed seconds, supervisor wall seconds) under the real CLI, its stdout to /dev/null."""
    elapsed = tmp / "elapsed-supervised"
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    port = free_port()
    argv = [*_child_argv(lines, elapsed, flushed, rate), "--port", str(port)]
    cfg = write_config(
        tmp / "kimi.toml",
        {
            "child": {"argv": [*argv, "--ready"] if after_ready else argv},
            "preflight": {"gpus": [], "check_model": False, "check_port": False},
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"poll_interval_s": 0.05},
            "shutdown": {"gpu_release_timeout_s": 0},
            "paths": {"runtime_directory": str(tmp / "run"), "state_directory": str(tmp / "state")},
        },
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    env["PYTHONPATH"] = str(REPO)
    prefix = os.environ.get("KIMI_BENCH_SUPERVISOR_PREFIX", "").split()  # e.g. "-m cProfile -o x.prof"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *prefix, "-m", "kimi_supervisor", "--config", str(cfg), "--log-format", fmt],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        check=False,
    )
    wall = time.monotonic() - start
    # The child exits on its own: 11 before READY, 13 after; both expected here.
    expected = {13 if after_ready else 11} | ({0} if prefix else set())  # cProfile's exit is 0
    assert done.returncode in expected, f"supervisor exited {done.returncode}: {done.stderr.decode()[-2000:]}"
    return float(elapsed.read_text()), wall


def _label(lines: int, flushed: bool, fmt: str, after_ready: bool) -> str:
    how = "flushed per line" if flushed else "unflushed"
    when = "after READY" if after_ready else "while starting"
    return f"{lines / 1e6:g}M lines, {how}, {fmt}, {when}"


def run() -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kimi-bench-flood-") as tmp_name:
        tmp = Path(tmp_name)
        for lines, flushed, fmt, after_ready in VARIANTS:
            plain: list[float] = []
            got: list[tuple[float, float]] = []
            for _ in range(RUNS):  # interleaved, so drift on the machine hits both alike
                plain.append(bare(tmp, lines, flushed))
                got.append(supervised(tmp, lines, flushed, fmt, after_ready))
            base = median(plain)
            child = median([g[0] for g in got])
            ratios = sorted(g[0] / p for g, p in zip(got, plain, strict=True))
            ratio = child / base
            rows.append(
                Row(
                    f"4. {_label(lines, flushed, fmt, after_ready)}: child / same writer into cat ({RUNS} runs)",
                    f"<= {TARGET_RATIO:.2f}x" if after_ready else "-",
                    f"{ratio:.2f}x (child {child:.2f} s, into cat {base:.2f} s, {lines / child / 1000:.0f}k lines/s;"
                    f" per run {', '.join(f'{r:.2f}' for r in ratios)}; supervisor wall"
                    f" {median([g[1] for g in got]):.2f} s)",
                    ratio <= TARGET_RATIO if after_ready else None,
                )
            )
    return rows + paced_rows() + fatal_rows()


PACED_LINES = 300_000
PACED_RATE = 100_000.0


def paced_rows() -> list[Row]:
    """A child that logs at 100k lines/s (far above vLLM's rate) instead of flat out: is it slowed at all?"""
    with tempfile.TemporaryDirectory(prefix="kimi-bench-paced-") as tmp_name:
        tmp = Path(tmp_name)
        plain = median([bare(tmp, PACED_LINES, False, PACED_RATE) for _ in range(2)])
        child = median([supervised(tmp, PACED_LINES, False, "json", True, PACED_RATE)[0] for _ in range(2)])
    ratio = child / plain
    return [
        Row(
            f"4. {PACED_LINES:,} lines paced at {PACED_RATE / 1000:.0f}k lines/s, json, after READY: child / cat",
            f"<= {TARGET_RATIO:.2f}x",
            f"{ratio:.3f}x (child {child:.2f} s, into cat {plain:.2f} s)",
            ratio <= TARGET_RATIO,
        ),
    ]


FATAL_RUNS = 3
FATAL_TARGET_S = 1.0


def fatal_rows() -> list[Row]:
    """vLLM's fatal record inside / right after a 300k-line flood: its write to the supervisor's exit record.
    tests/child/test_output.py checks that the record ends the run; how soon depends on the machine, so here."""
    rows = []
    for where, after in (("inside", FATAL_FLOOD_LINES // 2), ("right after", FATAL_FLOOD_LINES)):
        took = []
        for i in range(FATAL_RUNS):
            with tempfile.TemporaryDirectory(prefix="kimi-bench-fatal-") as tmp_name:
                got = fatal_after_flood(Path(tmp_name), after)
            assert got.rc == 13, f"supervisor exited {got.rc} (run {i}): {got.exit_event}"
            took.append(got.latency_s)
        rows.append(
            Row(
                f"4. fatal record {where} a {FATAL_FLOOD_LINES:,}-line flood after READY: its write to"
                f" supervisor.exit ({FATAL_RUNS} runs)",
                f"<= {FATAL_TARGET_S:.1f} s",
                f"max {max(took):.2f} s (per run {', '.join(f'{t:.2f}' for t in sorted(took))})",
                max(took) <= FATAL_TARGET_S,
            )
        )
    return rows


if __name__ == "__main__":
    for row in run():
        print(f"| {row.name} | {row.target} | {row.measured} | {row.verdict} |")
