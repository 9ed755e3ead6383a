"""A stand-in for vLLM 0.32's weight-cache daemon (`vllm preload`, issue 26) as the supervisor sees it from
outside, holding real GPU memory:

    python3 gpuaccept/weights_bin/vllm preload --model DIR -tp N --weight-cache-socket-dir D
        --weight-cache-health-port P [--weight-cache-health-host H]

* the parent (stdlib only, as preload.py's parent holds no CUDA context) spawns one process per local rank,
  named `vllm-weight-cache-target-<rank>` as preload.py names them (comm keeps 15 bytes);
* each rank reads DIR/weights.bin from disk into one tensor on GPU <rank> with torch (O_DIRECT where allowed),
  checks the sum against DIR/weights.json, then answers every connection on D/rank-<rank>.sock with the
  tensor's CUDA IPC handle (torch.multiprocessing.reductions.reduce_tensor), its size and its checksum;
* the parent's /health on H:P answers 503 until every rank reported ready, 200 after, 503 again once a rank
  died (preload.py's _HealthState); then it logs vLLM's READY line;
* SIGTERM/SIGINT: the ranks exit, which frees their GPU memory, then the parent exits 0.

Stand-in, not vLLM: the real daemon holds the post-processed TP shard of a model and checks the engine's cache
key and user; this one holds the bytes of one file and serves whoever connects.
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
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpuaccept.weights_common import READY_LINE, WEIGHTS_FILE, fake, load_to_gpu, rank_socket, read_meta, send_msg
from testkit.procutil import set_comm


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


def rank_main(rank: int, model: str, socket_dir: str, ready: Any) -> None:
    """One GPU's daemon: load, check, then serve the handle until SIGTERM."""
    set_comm(f"vllm-weight-cache-target-{rank}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    tensor, res = load_to_gpu(os.path.join(model, WEIGHTS_FILE), rank)
    want = read_meta(model)["checksum"]
    if res.checksum != want:
        say(f"rank {rank}: checksum {res.checksum} != {want} of {model}", "daemon.py:1", "ERROR")
        os._exit(1)
    gib = res.nbytes / (1 << 30)
    say(f"rank {rank}: loaded {gib:.2f} GiB in {res.seconds:.2f} s (O_DIRECT {res.direct})", "daemon.py:1")
    if fake():
        handle: Any = (bytes, (tensor,))  # "rebuilt" as a copy: the CPU run checks the protocol, not CUDA IPC
    else:
        from torch.multiprocessing.reductions import reduce_tensor

        handle = reduce_tensor(tensor)
    path = rank_socket(socket_dir, rank)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.settimeout(0.2)
    ready.put(("target", rank, res.nbytes, res.seconds, res.direct))
    served = 0
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        with conn:
            served += 1
            send_msg(conn, {"rank": rank, "nbytes": res.nbytes, "checksum": res.checksum, "handle": handle})
    server.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
    say(f"rank {rank}: stopping after {served} load(s) served", "daemon.py:1")
    del tensor
    os._exit(0)


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
    set_comm("vllm-preload")
    os.makedirs(ns.weight_cache_socket_dir, mode=0o700, exist_ok=True)
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
    stopping = threading.Event()

    def shutdown(*_: object) -> None:
        stopping.set()
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    seen = 0
    while seen < ns.tp and not stopping.is_set():
        try:
            _, rank, nbytes, seconds, direct = ready_q.get(timeout=1.0)
            seen += 1
            say(f"rank {rank} ready: {nbytes} bytes in {seconds:.2f} s, O_DIRECT {direct}", "preload.py:300")
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
    if not stopping.is_set():
        Health.ready.set()
        say(READY_LINE.format(n=ns.tp, dir=ns.weight_cache_socket_dir), "preload.py:321")
    for proc in procs:
        proc.join()
    httpd.shutdown()
    return 0 if stopping.is_set() else max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
