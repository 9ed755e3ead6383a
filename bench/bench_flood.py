"""Row 4: log forwarding, a child printing 1,000,000 lines of ~100 bytes, plain reader vs the supervisor."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, median
from tests.harness import REPO, write_config

FLOOD_CHILD = Path(__file__).resolve().parent / "flood_child.py"
LINES = 1_000_000
RUNS = 3
TARGET_LINES_S = 100_000
TARGET_SLOWDOWN = 1.10


def _plain(tmp: Path) -> float:
    """The child's elapsed seconds with a reader that only drains the pipe."""
    elapsed = tmp / "elapsed-plain"
    proc = subprocess.Popen([sys.executable, str(FLOOD_CHILD), str(LINES), str(elapsed)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while os.read(fd, 65536):
        pass
    proc.wait()
    return float(elapsed.read_text())


def _supervised(tmp: Path, fmt: str) -> tuple[float, float]:
    """(child's elapsed seconds, supervisor wall seconds) under the real CLI, its stdout to /dev/null."""
    elapsed = tmp / f"elapsed-{fmt}"
    shm = tmp / "shm"
    shm.mkdir(exist_ok=True)
    cfg = write_config(
        tmp / f"kimi-{fmt}.toml",
        {
            "child": {"argv": [sys.executable, str(FLOOD_CHILD), str(LINES), str(elapsed)]},
            "preflight": {"gpus": [], "check_model": False, "check_port": False},
            "preflight.shm": {"directory": str(shm)},
            "shutdown": {"gpu_release_timeout_s": 0},
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
    # 11: the child exits before it was ever ready, which is expected here.
    assert done.returncode == 11, f"supervisor exited {done.returncode}: {done.stderr.decode()[-2000:]}"
    return float(elapsed.read_text()), wall


def run() -> list[Row]:
    plain: list[float] = []
    by_fmt: dict[str, list[tuple[float, float]]] = {"json": [], "console": []}
    with tempfile.TemporaryDirectory(prefix="kimi-bench-flood-") as tmp_name:
        tmp = Path(tmp_name)
        for _ in range(RUNS):  # interleaved, so drift on the machine hits every variant alike
            plain.append(_plain(tmp))
            for fmt, results in by_fmt.items():
                results.append(_supervised(tmp, fmt))
    base = median(plain)
    rows = [Row(f"4. {LINES:,} lines, plain reader ({RUNS} runs)", "-", f"child {base:.3f} s", None)]
    for fmt, results in by_fmt.items():
        child = median([r[0] for r in results])
        wall = median([r[1] for r in results])
        rate = LINES / child
        rows.append(
            Row(
                f"4. through the supervisor, --log-format {fmt}",
                f">= {TARGET_LINES_S // 1000}k lines/s; child <= {TARGET_SLOWDOWN:.2f}x plain",
                f"{rate / 1000:.0f}k lines/s; child {child:.2f} s = {child / base:.1f}x plain; "
                f"supervisor wall {wall:.2f} s",
                rate >= TARGET_LINES_S and child / base <= TARGET_SLOWDOWN,
            )
        )
    return rows
