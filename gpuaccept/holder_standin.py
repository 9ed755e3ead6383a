"""A stand-in for vLLM 0.32's weight-cache daemon (`vllm preload`, docs/weight-holder.md) as the supervisor sees it from
outside, with real GPU memory, the real daemon's shape (docs/weight-holder.md; the vLLM source line of each behaviour
beside it):

    python3 gpuaccept/weights_bin/vllm preload --model DIR -tp N --weight-cache-socket-dir D
        --weight-cache-health-port P [--weight-cache-health-host H]

* the parent (stdlib only, as preload.py's parent holds no CUDA context) spawns one process per local rank
  (preload.py:239 `get_context("spawn")`): `python3 -c from multiprocessing.spawn import spawn_main; ...`, no
  process title of vLLM's (`vllm-weight-cache-target-<rank>` is only the Process object's name, 265-268);
* a rank prints nothing (daemon.py:476-501: it never sets vLLM's logging up, so its INFO lines never appear);
  it reads DIR/weights.bin into one tensor on GPU <rank> with torch (O_DIRECT where allowed), checks the sum
  against DIR/weights.json, makes D (daemon.py:345-347; as its own user, after the load), binds
  D/vllm_weight_cache_<md5 of the GPU's uuid>.sock 0600 (protocol.py:135-151, daemon.py:353-356) and answers
  `get_memory` with torch's allocated bytes (daemon.py:419-426) and `get_state` with the tensor's CUDA IPC
  handle, its size and checksum; a peer of another uid is rejected (protocol.py:212-228);
* the parent's /health on H:P answers 503 until every rank reported ready, 200 after, 503 again once a rank
  died (preload.py:54-78); then it logs vLLM's READY line (preload.py:321);
* SIGTERM/SIGINT: the parent terminates the ranks (preload.py:289-296), which die of the signal (their memory
  freed with them), and exits `max(exitcode)` = -15, status 241 (preload.py:337);
* a SIGKILLed parent leaves its ranks running (spawn children are not tied to it): the supervisor stops them.

Stand-in, not vLLM: the real daemon holds the post-processed TP shard of a model and checks the engine's cache
key; this one holds the bytes of one file.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import multiprocessing as mp
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpuaccept.weights_common import (
    READY_LINE,
    WEIGHTS_FILE,
    fake,
    load_to_gpu,
    rank_socket,
    read_meta,
    recv_msg,
    send_msg,
)


def say(msg: str, where: str = "preload.py:260", level: str = "INFO") -> None:
    sys.stdout.write(f"{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}\n")
    sys.stdout.flush()


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm preload (stand-in)")
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp")
    p.add_argument("--weight-cache-socket-dir", required=True)
    p.add_argument("--weight-cache-health-port", type=int, required=True)
    p.add_argument("--weight-cache-health-host", default="0.0.0.0")
    ns, _ = p.parse_known_args(list(argv))  # the engine's flags (dtype, quantization...) are accepted, ignored
    return ns


def _answer(conn: socket.socket, res: Any, handle: Any) -> None:
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    request = recv_msg(conn)
    if uid != os.getuid():
        send_msg(conn, {"status": "error", "message": f"Rejecting weight cache connection from uid {uid}"})
    elif request.get("cmd") == "get_memory":
        nbytes = res.nbytes
        if not fake():
            import torch

            nbytes = torch.cuda.memory_allocated()
        send_msg(conn, {"status": "ok", "memory_bytes": nbytes})
    else:
        send_msg(conn, {"status": "ok", "nbytes": res.nbytes, "checksum": res.checksum, "handle": handle})


def rank_main(rank: int, model: str, socket_dir: str, ready: Any) -> None:
    """One GPU's daemon: load, check, then serve until killed (no SIGTERM handler, as vLLM's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    if not fake():
        import torch

        torch.cuda.set_device(rank)
    tensor, res = load_to_gpu(os.path.join(model, WEIGHTS_FILE), rank)
    want = read_meta(model)["checksum"]
    if res.checksum != want:
        sys.stderr.write(f"rank {rank}: checksum {res.checksum} != {want} of {model}\n")  # as an exception would
        os._exit(1)
    if fake():
        handle: Any = (bytes, (tensor,))  # "rebuilt" as a copy: the CPU run checks the protocol, not CUDA IPC
    else:
        from torch.multiprocessing.reductions import reduce_tensor

        handle = reduce_tensor(tensor)
    os.makedirs(socket_dir, mode=0o700, exist_ok=True)
    path = rank_socket(socket_dir, rank)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(8)
    ready.put(("target", rank, res.nbytes, res.seconds, res.direct))
    while True:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError, ValueError, EOFError):
            _answer(conn, res, handle)


class Health(http.server.BaseHTTPRequestHandler):
    procs: ClassVar[list[Any]] = []
    ready = threading.Event()

    def do_GET(self) -> None:
        alive = all(p.exitcode is None for p in self.procs)
        code = (200 if self.ready.is_set() and alive else 503) if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        del format, args


def main(argv: Sequence[str]) -> int:
    ns = parse(argv)
    ctx = mp.get_context("spawn")  # as vLLM: a fresh interpreter per rank, no CUDA state inherited
    ready_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, ns.model, ns.weight_cache_socket_dir, ready_q),
            name=f"vllm-weight-cache-target-{r}",
        )
        for r in range(ns.tp)
    ]
    Health.procs = procs
    httpd = http.server.ThreadingHTTPServer((ns.weight_cache_health_host, ns.weight_cache_health_port), Health)
    threading.Thread(target=httpd.serve_forever, name="vllm-weight-cache-health", daemon=True).start()
    say(f"Launching {ns.tp} weight cache daemon(s) for {ns.model}")
    for proc in procs:
        proc.start()
    # Set by the signal handler, which takes no lock, as vLLM's `_shutdown` (preload.py:289-296) takes none: a
    # handler runs between two bytecodes of the main thread, also inside its own first run when a second SIGTERM
    # comes (the supervisor signals the process group and each member: two), and a lock the first run holds
    # (threading.Event.set's) would stop the second forever: the holder outlived the stop's grace until SIGKILL.
    stopping: list[bool] = []

    def shutdown(*_: object) -> None:
        stopping.append(True)
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    seen = 0
    while seen < ns.tp and not stopping:
        try:
            ready_q.get(timeout=1.0)  # the real parent logs nothing per rank either (preload.py:298-301)
            seen += 1
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead:
                say(f"Weight cache daemon rank(s) exited during startup (exitcodes={dead}); shutting down.",
                    "preload.py:304", "ERROR")  # fmt: skip
                shutdown()
                for proc in procs:
                    proc.join()
                httpd.shutdown()
                return max(code or 0 for code in dead) or 1
    if not stopping:
        Health.ready.set()
        say(READY_LINE.format(n=ns.tp, dir=ns.weight_cache_socket_dir), "preload.py:321")
    for proc in procs:
        proc.join()
    httpd.shutdown()
    return max(p.exitcode or 0 for p in procs)  # -15 after a SIGTERM: status 241, as preload.py:337


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
