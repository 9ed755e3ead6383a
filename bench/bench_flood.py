"""Row 4: log forwarding, a child printing 1,000,000 lines of ~100 bytes, plain reader vs the supervisor."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, median
from testkit.harness import REPO, free_port, write_config

FLOOD_CHILD = Path(__file__).resolve().parent / "flood_child.py"
LINES = 1_000_000
RUNS = 2
TARGET_LINES_S = 100_000
TARGET_SLOWDOWN = 1.10
# (label, --log-format, flood after READY): while starting, every line also goes through the readiness tracker.
VARIANTS = (
    ("json, while starting", "json", False),
    ("console, while starting", "console", False),
    ("json, after READY", "json", True),
)


def _plain(tmp: Path, lines: int = LINES, rate: float = 0.0) -> float:
    """The child's elapsed seconds with a reader that only drains the pipe."""
    elapsed = tmp / "elapsed-plain"
    proc = subprocess.Popen(
        [sys.executable, str(FLOOD_CHILD), str(lines), str(elapsed), "--rate", str(rate)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while os.read(fd, 65536):
        pass
    proc.wait()
    return float(elapsed.read_text())


def _supervised(tmp: Path, fmt: str, after_ready: bool, lines: int = LINES, rate: float = 0.0) -> tuple[float, float]:
    """(child's elapsed seconds, supervisor wall seconds) under the real CLI, its stdout to /dev/null."""
    elapsed = tmp / "elapsed-supervised"
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    port = free_port()
    argv = [sys.executable, str(FLOOD_CHILD), str(lines), str(elapsed), "--port", str(port), "--rate", str(rate)]
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
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(cfg), "--log-format", fmt],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        check=False,
    )
    wall = time.monotonic() - start
    # The child exits on its own: 11 before READY, 13 after; both expected here.
    expected = 13 if after_ready else 11
    assert done.returncode == expected, f"supervisor exited {done.returncode}: {done.stderr.decode()[-2000:]}"
    return float(elapsed.read_text()), wall


def run() -> list[Row]:
    plain: list[float] = []
    results: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kimi-bench-flood-") as tmp_name:
        tmp = Path(tmp_name)
        for _ in range(RUNS):  # interleaved, so drift on the machine hits every variant alike
            plain.append(_plain(tmp))
            for label, fmt, after_ready in VARIANTS:
                results[label].append(_supervised(tmp, fmt, after_ready))
    base = median(plain)
    rows = [Row(f"4. {LINES:,} lines, plain reader ({RUNS} runs)", "-", f"child {base:.3f} s", None)]
    for label, got in results.items():
        child = median([r[0] for r in got])
        rate = LINES / child
        wall = median([r[1] for r in got])
        rows += [
            Row(
                f"4. through the supervisor, {label}",
                f">= {TARGET_LINES_S // 1000}k lines/s",
                f"{rate / 1000:.0f}k lines/s (child {child:.2f} s, supervisor wall {wall:.2f} s)",
                rate >= TARGET_LINES_S,
            ),
            Row(
                f"4.   child slowdown vs plain reader, {label}",
                f"<= {TARGET_SLOWDOWN:.2f}x",
                f"{child / base:.0f}x",
                child / base <= TARGET_SLOWDOWN,
            ),
        ]
    return rows + paced_rows()


PACED_LINES = 300_000
PACED_RATE = 100_000.0


def paced_rows() -> list[Row]:
    """A child that logs at 100k lines/s (far above vLLM's rate) instead of flat out: is it slowed at all?"""
    with tempfile.TemporaryDirectory(prefix="kimi-bench-paced-") as tmp_name:
        tmp = Path(tmp_name)
        plain = median([_plain(tmp, PACED_LINES, PACED_RATE) for _ in range(RUNS)])
        json_child = median([_supervised(tmp, "json", False, PACED_LINES, PACED_RATE)[0] for _ in range(RUNS)])
    ratio = json_child / plain
    return [
        Row(
            f"4. {PACED_LINES:,} lines paced at {PACED_RATE / 1000:.0f}k lines/s, plain reader",
            "-",
            f"child {plain:.2f} s",
            None,
        ),
        Row(
            "4.   child slowdown vs plain reader, json, while starting, paced",
            f"<= {TARGET_SLOWDOWN:.2f}x",
            f"{ratio:.3f}x (child {json_child:.2f} s)",
            ratio <= TARGET_SLOWDOWN,
        ),
    ]
