"""A fake `vllm preload` (the weight holder of issue 26) as the supervisor sees it from outside, stdlib only.

`fake_vllm.py preload --model M -tp N --weight-cache-socket-dir D --weight-cache-health-port P
[--weight-cache-health-host H] [--load-seconds S] [--never-ready] [--max-lifetime S]`:

* one forked process per rank, titled `vllm-weight-cache-target-<rank>` (vLLM's multiprocessing names), each
  holding a Unix socket `D/rank-<rank>.sock` (the real daemon's socket is per GPU uuid; the name is not the
  point here, the directory is);
* /health on H:P answering 503 while loading and 200 once every rank is up, as preload.py's does;
* after `--load-seconds`, vLLM's READY line, as a vLLM log record of the parent
  (`===== Weight cache daemon READY: node 0/1 serving N local rank(s) x 1 role(s) in D =====`);
* SIGTERM: the ranks and the parent exit 0.  The real daemon refuses without CUDA IPC; this one never does.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

from testkit.fakes import fake_vllm_proc as proc
from testkit.fakes.fake_vllm_output import log


class _Health(http.server.BaseHTTPRequestHandler):
    ready = threading.Event()

    def do_GET(self) -> None:
        status = 200 if self.path == "/health" and self.ready.is_set() else 503 if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        del format, args


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake_vllm.py preload")
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp")
    p.add_argument("--weight-cache-socket-dir", required=True)
    p.add_argument("--weight-cache-health-port", type=int, required=True)
    p.add_argument("--weight-cache-health-host", default="0.0.0.0")
    p.add_argument("--load-seconds", type=float, default=0.5)
    p.add_argument("--never-ready", action="store_true", help="load forever: /health stays 503, no READY line")
    p.add_argument("--max-lifetime", type=float, default=600.0)
    ns, _ = p.parse_known_args(list(argv))  # vLLM's EngineArgs (dtype, quantization...) are accepted, ignored
    return ns


def _rank(rank: int, sockets: str) -> NoReturn:
    path = os.path.join(sockets, f"rank-{rank}.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    code = 0
    try:
        while True:
            proc.pause(3600)
    except proc.Stop:
        code = 0
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    os._exit(code)


def main(argv: Sequence[str]) -> NoReturn:
    ns = _parse(argv)
    proc.P.pid = os.getpid()
    proc.P.label = "APIServer"
    proc.P.deadline = time.monotonic() + ns.max_lifetime
    proc.install_term(False)
    sockets = ns.weight_cache_socket_dir
    # vLLM's own before it binds (weight_cache/protocol.py ensure_private_socket_dir ~154-163, verify_private_dir
    # ~166-186, strict_perms off for an explicit --weight-cache-socket-dir): makedirs as this uid, then a real
    # directory this uid owns, else WeightCacheUnavailableError and exit 1.
    os.makedirs(sockets, mode=0o700, exist_ok=True)
    info = os.lstat(sockets)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        log("ERROR", "daemon.py:345", f"Socket directory {sockets} is not owned by the current user")
        raise SystemExit(1)
    httpd = http.server.ThreadingHTTPServer((ns.weight_cache_health_host, ns.weight_cache_health_port), _Health)
    threading.Thread(target=httpd.serve_forever, name="vllm-weight-cache-health", daemon=True).start()
    ranks: list[int] = []
    code = 0
    try:
        for rank in range(ns.tp):
            pid = proc.fork_child(
                f"WeightCache_TP{rank}",
                f"vllm-weight-cache-target-{rank}",
                close_fds=[httpd.fileno()],
                orphan=False,
                ignore_term=False,
            )
            if pid == 0:
                _rank(rank, sockets)
            ranks.append(pid)
        log("INFO", "preload.py:260", f"Launching {ns.tp} weight cache daemon(s) for {ns.model}")
        if ns.never_ready:
            proc.pause(ns.max_lifetime)
        proc.pause(ns.load_seconds)
        _Health.ready.set()
        log(
            "INFO",
            "preload.py:321",
            f"===== Weight cache daemon READY: node 0/1 serving {ns.tp} local rank(s) x 1 role(s) in {sockets} =====",
        )
        while True:
            proc.pause(3600)
    except proc.Stop as stop:
        code = 0 if stop.reason in ("signal", "lifetime") else 1
    finally:
        _Health.ready.clear()
        httpd.shutdown()
        proc.stop_children(ranks, graceful=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os._exit(code)
