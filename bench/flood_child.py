#!/usr/bin/env python3
"""Prints N lines of about 100 bytes to stdout as fast as it can; writes its elapsed seconds to a file.

    flood_child.py N ELAPSED_FILE [--port PORT] [--ready] [--rate LINES_PER_S] [--hold]

With --ready it first plays a ready vLLM (stdlib only): prints "Application
startup complete.", answers GET /health on 127.0.0.1:PORT with 200, and
floods only once /health has been answered (so the supervisor is past READY).
With --hold it keeps answering /health after the flood, until SIGTERM (a
server that was merely chatty), after printing what it achieved.
"""

from __future__ import annotations

import argparse
import http.server
import sys
import threading
import time

LINES_PER_WRITE = 1000
PACED_BATCH = 100


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lines", type=int)
    parser.add_argument("elapsed_file")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ready", action="store_true")
    parser.add_argument("--rate", type=float, default=0.0, help="pace the output at this many lines/s (0: flat out)")
    parser.add_argument("--hold", action="store_true", help="after the flood, serve /health until SIGTERM")
    args = parser.parse_args()
    if args.ready:
        wait_until_probed(args.port)
    stdout = sys.stdout.buffer
    pad = "x" * 60
    # Shaped like vLLM's lines, 104 bytes each with the newline; one chunk built once, written again and again.
    lines = [f"(Worker_TP{i % 8} pid=4242) INFO flood line {i:05d} {pad}\n".encode() for i in range(LINES_PER_WRITE)]
    chunk = b"".join(lines)
    start = time.monotonic()
    done = 0
    batch = LINES_PER_WRITE if not args.rate else PACED_BATCH
    while done < args.lines:
        count = min(batch, args.lines - done)
        stdout.write(chunk if count == LINES_PER_WRITE else b"".join(lines[:count]))
        done += count
        if args.rate:
            # A logging server, not a firehose: each batch is due at done / rate seconds.
            stdout.flush()
            delay = start + done / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    stdout.flush()
    elapsed = time.monotonic() - start
    with open(args.elapsed_file, "w") as fh:
        fh.write(repr(elapsed))
    if args.hold:
        # A second later (a fresh metering second), say what was achieved; then serve quietly.
        time.sleep(1.1)
        print(f"WARNING flood done: {done} lines in {elapsed:.2f} s ({done / elapsed:.0f} lines/s)", flush=True)
        while True:  # SIGTERM's default action ends it
            time.sleep(3600)


if __name__ == "__main__":
    main()
