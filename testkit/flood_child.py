#!/usr/bin/env python3
"""Prints N vLLM-shaped lines to stdout as fast as it can; writes its elapsed seconds to a file.

    flood_child.py N ELAPSED_FILE [--port PORT] [--ready] [--flush] [--rate LINES_PER_S] [--hold]
                   [--fatal-after K --fatal-file PATH]

Each line is one of vLLM's stats lines (`(APIServer pid=N) INFO 11-29 17:07:32 [loggers.py:123] Engine 000:
Avg prompt throughput ...`, about 200 bytes), printed with print(): block-buffered (8 KiB, Python's
default for a pipe, whatever PYTHONUNBUFFERED says), or with --flush one write per line as vLLM's logger
does.  With --ready it first plays a ready vLLM (stdlib only): prints "Application startup complete.",
answers GET /health on 127.0.0.1:PORT with 200, and floods only once /health has been answered (so the
supervisor is past READY).  With --hold it keeps answering /health after the flood, until SIGTERM (a
server that was merely chatty), after printing what it achieved.  With --fatal-after K, vLLM's own fatal
record (EngineCore's "died unexpectedly", from tests/fixtures) follows the K-th line, flushed, and
the CLOCK_MONOTONIC time just after it goes to --fatal-file (the tests' start of "acted on within 1 s").
Beside ELAPSED_FILE: ELAPSED_FILE.cpu (its CPU seconds) and ELAPSED_FILE.waited (seconds it was runnable
but waited for a CPU: the machine's load, which bench/bench_flood.py takes out of the elapsed time).
"""

from __future__ import annotations

import argparse
import array
import fcntl
import http.server
import os
import sys
import termios
import threading
import time

DISTINCT = 1000  # lines built once and printed in turn: the writer's own cost per line stays that of print()
PACED_BATCH = 100
FATAL = (
    "(EngineCore pid=566) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died"
    " unexpectedly (exit code: -9), shutting down executor."
)


def wait_until_probed(port: int) -> threading.Event:
    probed = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            probed.set()

        def log_message(self, format: str, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("INFO:     Application startup complete.", flush=True)
    probed.wait(30)
    time.sleep(0.5)  # the supervisor sends READY=1 within milliseconds of the 200
    return probed


def run_delay_s() -> float:
    """Seconds this thread has waited for a CPU while runnable (/proc/thread-self/schedstat's second field).

    That wait is the machine's load, not the reader's: a writer blocked on a full pipe sleeps and is not
    runnable, so its elapsed time minus this is what the reader cost it plus its own work."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_of(pid: int) -> float:
    """CPU seconds of every thread of `pid` (/proc/PID/task/*/schedstat: nanoseconds, not clock ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # that thread just ended
    return total / 1e9


def drained(fd: int, bound_s: float = 60.0) -> None:
    """Until the reader has taken every byte written into the pipe `fd` (FIONREAD: bytes still unread)."""
    deadline = time.monotonic() + bound_s
    unread = array.array("i", [0])
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, unread)
        except OSError:
            return  # not a pipe
        if unread[0] == 0:
            return
        time.sleep(0.001)


def vllm_lines(count: int = DISTINCT) -> list[str]:
    return [
        f"(APIServer pid=213806) INFO 11-29 17:{i // 60 % 60:02d}:{i % 60:02d} [loggers.py:123] Engine 000: "
        f"Avg prompt throughput: {i % 97 * 10.5:.1f} tokens/s, Avg generation throughput: {i % 89 * 3.25:.1f} "
        f"tokens/s, Running: {i % 7} reqs, Waiting: 0 reqs, GPU KV cache usage: {i % 100 / 10:.1f}%, "
        f"Prefix cache hit rate: {i % 53:.1f}%"
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lines", type=int)
    parser.add_argument("elapsed_file")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ready", action="store_true")
    parser.add_argument("--flush", action="store_true", help="flush after every line (vLLM's logging handler)")
    parser.add_argument("--rate", type=float, default=0.0, help="pace the output at this many lines/s (0: flat out)")
    parser.add_argument("--hold", action="store_true", help="after the flood, serve /health until SIGTERM")
    parser.add_argument("--fatal-after", type=int, default=-1, help="print vLLM's fatal record after line K")
    parser.add_argument("--fatal-file", default="", help="where the time of the fatal record goes")
    args = parser.parse_args()
    if args.ready:
        wait_until_probed(args.port)
    sys.stdout.flush()
    out = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 - our own stream, 8 KiB buffer
    lines = vllm_lines()
    start = time.monotonic()
    cpu = time.process_time()
    waited_before = run_delay_s()
    reader_before = cpu_of(os.getppid())
    done = 0
    if args.rate:
        while done < args.lines:
            count = min(PACED_BATCH, args.lines - done)
            for i in range(done, done + count):
                print(lines[i % DISTINCT], file=out)
            out.flush()
            done += count
            # A logging server, not a firehose: each batch is due at done / rate seconds.
            delay = start + done / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    else:
        fatal_at = args.fatal_after if args.fatal_after >= 0 else args.lines + 1
        for i in range(args.lines + 1):
            if i == fatal_at:
                print(FATAL, file=out, flush=True)
                with open(args.fatal_file, "w") as fh:
                    fh.write(repr(time.monotonic()))
            if i < args.lines:
                print(lines[i % DISTINCT], file=out, flush=args.flush)
        done = args.lines
    out.flush()
    elapsed = time.monotonic() - start
    with open(args.elapsed_file, "w") as fh:
        fh.write(repr(elapsed))
    if args.elapsed_file != "/dev/null":
        with open(args.elapsed_file + ".cpu", "w") as fh:  # elapsed - cpu: the time it waited (a full pipe)
            fh.write(repr(time.process_time() - cpu))
        with open(args.elapsed_file + ".waited", "w") as fh:
            fh.write(repr(run_delay_s() - waited_before))
        drained(1)
        with open(args.elapsed_file + ".reader", "w") as fh:  # the parent's CPU while it read the flood
            fh.write(repr(cpu_of(os.getppid()) - reader_before))
    if args.hold:
        # A second later (a fresh metering second), say what was achieved; then serve quietly.
        time.sleep(1.1)
        print(f"WARNING flood done: {done} lines in {elapsed:.2f} s ({done / elapsed:.0f} lines/s)", file=out)
        out.flush()
        while True:  # SIGTERM's default action ends it
            time.sleep(3600)


if __name__ == "__main__":
    main()
