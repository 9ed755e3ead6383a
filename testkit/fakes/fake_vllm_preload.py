"""A fake `vllm preload` (the weight holder of docs/weight-holder.md) that behaves as vLLM 0.32's does from outside,
stdlib only.

`fake_vllm.py preload --model M -tp N --weight-cache-socket-dir D --weight-cache-health-port P
[--weight-cache-health-host H] [--load-seconds S] [--never-ready] [--held-bytes B] [--max-lifetime S]`

What the real daemon does, and this one with it (vllm/entrypoints/cli/preload.py, PRELOAD below;
vllm/model_executor/model_loader/weight_cache/daemon.py, DAEMON below):

* one rank per GPU, a `multiprocessing` spawn child (preload.py:239 `get_context("spawn")`, 251-276): its
  command line is `python3 -c from multiprocessing.spawn import spawn_main; ...`, no vLLM process title (the
  `vllm-weight-cache-target-<rank>` name is only the Process object's, preload.py:265-268);
* a rank prints nothing: it never sets vLLM's logging up (daemon.py:476-501 `_run_daemon` calls no
  `configure_logging`, which only engines call: v1/engine/core.py:1395), so its INFO lines ("loaded model",
  "serving on", "sent N tensors") never appear, and the parent is silent from the launch to the READY line;
* each rank, once loaded, makes its socket directory (daemon.py:345-347), binds
  `D/vllm_weight_cache_<md5 of its GPU's uuid>.sock` 0600 (protocol.py:42, 135-151; daemon.py:353-356) and then
  reports ready; it answers `get_memory` with its allocator's bytes (daemon.py:419-426) and rejects a peer of
  another uid (protocol.py:212-228);
* /health (preload.py:54-78) answers 503 until every rank reported ready, 200 after, 503 once a rank died; then
  the parent logs the READY line (preload.py:321-329);
* SIGTERM: the parent terminates the ranks (preload.py:289-296), which die of the signal (no handler: their
  exit code is -15, and the socket stays behind, as serve_forever's `finally` never runs), and exits with
  `sys.exit(max(exitcode))` (preload.py:337), so -15: status 241;
* a SIGKILLed parent leaves its ranks running (nothing ties a spawn child to its parent's life).

The real daemon refuses without CUDA IPC; this one never does.  `--max-lifetime` bounds every process of it, so
a test that fails can leak nothing for long: that is the fake's, not vLLM's.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.server
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from testkit.fakes import fake_vllm_proc as proc
from testkit.fakes.fake_vllm_output import log

_LEN = struct.Struct("!Q")


class _Health(http.server.BaseHTTPRequestHandler):
    ready = threading.Event()
    procs: Sequence[BaseProcess] = ()

    def do_GET(self) -> None:
        ok = self.ready.is_set() and not any(p.exitcode is not None for p in self.procs)
        status = (200 if ok else 503) if self.path == "/health" else 404
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
    p.add_argument("--held-bytes", type=int, default=1 << 30, help="each rank's answer to get_memory")
    p.add_argument("--max-lifetime", type=float, default=600.0)
    ns, _ = p.parse_known_args(list(argv))  # vLLM's EngineArgs (dtype, quantization...) are accepted, ignored
    return ns


def socket_path(sockets: str, rank: int) -> str:
    """protocol.py:135-151 for this fake's GPU `rank`, whose uuid is GPU-fake-<rank>."""
    return os.path.join(sockets, f"vllm_weight_cache_{hashlib.md5(f'GPU-fake-{rank}'.encode()).hexdigest()}.sock")


def _exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _answer(conn: socket.socket, held_bytes: int) -> None:
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    (n,) = _LEN.unpack(_exact(conn, _LEN.size))
    request = pickle.loads(_exact(conn, n))
    reply: dict[str, Any]
    if uid != os.getuid():
        reply = {"status": "error", "message": f"Rejecting weight cache connection from uid {uid}"}
    elif isinstance(request, dict) and request.get("cmd") == "get_memory":
        reply = {"status": "ok", "memory_bytes": held_bytes}
    else:
        reply = {"status": "error", "message": f"Unknown command {request!r}"}
    body = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(_LEN.pack(len(body)) + body)


def _bound(seconds: float, then: Any, *args: object) -> None:
    """The fake's own lifetime bound (never vLLM's): a daemon timer, so it never holds an exit up."""
    timer = threading.Timer(seconds, then, args)
    timer.daemon = True
    timer.start()


def _rank(rank: int, sockets: str, ns: argparse.Namespace, ready: Any) -> None:
    """One GPU's daemon (daemon.py:476-501): load silently, bind, report ready, serve until killed."""
    _bound(ns.max_lifetime, os._exit, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if ns.never_ready:
        time.sleep(ns.max_lifetime)
    time.sleep(ns.load_seconds)
    # vLLM's own before it binds (weight_cache/protocol.py ensure_private_socket_dir ~154-163, verify_private_dir
    # ~166-186, strict_perms off for an explicit --weight-cache-socket-dir): makedirs as this uid, then a real
    # directory this uid owns, else WeightCacheUnavailableError: the rank dies and the parent exits (preload.py:305).
    os.makedirs(sockets, mode=0o700, exist_ok=True)
    info = os.lstat(sockets)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"Socket directory {sockets} is not owned by the current user")
    path = socket_path(sockets, rank)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen()
    ready.put(("target", rank))
    while True:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError, ValueError, pickle.UnpicklingError):
            _answer(conn, ns.held_bytes)


def main(argv: Sequence[str]) -> NoReturn:
    ns = _parse(argv)
    proc.P.pid = os.getpid()
    proc.P.label = "APIServer"
    sockets = ns.weight_cache_socket_dir
    ctx = multiprocessing.get_context("spawn")
    ready_q: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, sockets, ns, ready_q), name=f"vllm-weight-cache-target-{r}")
        for r in range(ns.tp)
    ]
    _Health.procs = procs
    httpd = http.server.ThreadingHTTPServer((ns.weight_cache_health_host, ns.weight_cache_health_port), _Health)
    threading.Thread(target=httpd.serve_forever, name="vllm-weight-cache-health", daemon=True).start()
    log("INFO", "preload.py:286", f"Launching {ns.tp} weight cache daemon(s) for {ns.model}")
    for rank in procs:
        rank.start()

    def shutdown(*_: object) -> None:
        for rank in procs:
            rank.terminate()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    _bound(ns.max_lifetime, shutdown)
    seen: set[tuple[str, int]] = set()
    while len(seen) < ns.tp:
        try:
            seen.add(ready_q.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead:
                why = f"Weight cache daemon rank(s) exited during startup (exitcodes={dead}); shutting down."
                log("ERROR", "preload.py:305", why)
                shutdown()
                for rank in procs:
                    rank.join()
                httpd.shutdown()
                sys.exit(max((p.exitcode or 0) for p in procs))
    _Health.ready.set()
    log(
        "INFO",
        "preload.py:321",
        f"===== Weight cache daemon READY: node 0/1 serving {ns.tp} local rank(s) x 1 role(s) in {sockets} =====",
    )
    for rank in procs:
        rank.join()
    httpd.shutdown()
    sys.exit(max(rank.exitcode or 0 for rank in procs))
