#!/usr/bin/env python3
"""Imitates vLLM's readiness for the READY=1 latency benchmark (stdlib only).

    ready_child.py --port PORT [--host H] [--listen-after S] [--listening-marker FILE] MARKER_FILE

Prints uvicorn's "Application startup complete." line, listens after
--listen-after seconds, answers GET /health with 200, and writes
time.monotonic() (CLOCK_MONOTONIC: system-wide, comparable across processes)
into MARKER_FILE just before it sends its first 200; with --listening-marker,
the moment it starts listening (the first moment a probe could get a 200).
"""

from __future__ import annotations

import argparse
import http.server
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--listen-after", type=float, default=0.0)
    parser.add_argument("--listening-marker", default=None)
    parser.add_argument("marker")
    args = parser.parse_args()
    first = [True]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                self.send_error(404)
                return
            if first[0]:
                first[0] = False
                with open(args.marker, "w") as fh:
                    fh.write(repr(time.monotonic()))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *a: object) -> None:
            return

    print("INFO:     Application startup complete.", flush=True)
    time.sleep(args.listen_after)
    server = http.server.HTTPServer((args.host, args.port), Handler)  # binds and listens
    if args.listening_marker:
        with open(args.listening_marker, "w") as fh:
            fh.write(repr(time.monotonic()))
    print(f"INFO:     Uvicorn running on http://{args.host}:{args.port}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
