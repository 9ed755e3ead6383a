"""A stand-in for `vllm serve` that gets its weights either from the weight holder (docs/weight-holder.md) or from disk:

    python3 gpuaccept/weights_bin/vllm serve DIR --host H --port P --tensor-parallel-size N
        [--load-format ipc_cache --model-loader-extra-config '{"socket_dir": D, "fallback": false}']

* `--load-format ipc_cache`: vLLM's memory rule first (request_memory: free >= total x util - the daemon's
  get_memory answer, else its ValueError); then for each rank, ask vLLM's socket for GPU <rank> (`get_state`),
  rebuild the held tensor from its CUDA IPC handle (no copy: the holder's memory, mapped) and sum its bytes on
  the GPU against the holder's checksum and DIR/weights.json; an unreachable holder with `"fallback": false` is
  fatal, as in vLLM;
* otherwise: read DIR/weights.bin from disk onto each GPU (O_DIRECT where allowed) and check the same sum;
* then vLLM 0.32's startup lines ("Loading weights took", "Starting vLLM server on", "Application startup
  complete.") and GET /health 200 on H:P, so the supervisor's readiness takes it for vLLM;
* `--kv-cache-memory-bytes N`: N bytes of its own on each GPU after the weights (vLLM's KV cache, as a hot spare
  sizes it: docs/spare.md); `--uds PATH`: /health on that Unix socket instead of H:P (an engine behind its front);
* SIGTERM: exit 0.  WEIGHTS_BENCH_DIR: where it writes engine-<pid>.json, its times on CLOCK_MONOTONIC (one
  clock for every process of the machine, so the bench can put them beside the supervisor's and its own).
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # before any import that costs: the spawn is as early as the child can see

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import socketserver  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpuaccept.weights_common import (  # noqa: E402
    GIB,
    WEIGHTS_FILE,
    connect,
    fake,
    gpu_checksum,
    load_to_gpu,
    rank_socket,
    read_meta,
    recv_msg,
    send_msg,
)
from testkit.procutil import set_comm  # noqa: E402

TIMES: dict[str, Any] = {"pid": os.getpid(), "t_start": T_START}


def say(msg: str, where: str, who: str = "APIServer") -> None:
    sys.stdout.write(f"({who} pid={os.getpid()}) INFO {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}\n")
    sys.stdout.flush()


_RECORDING = threading.Lock()


def record() -> None:
    # The main thread (after the startup line) and the first 200's handler thread both record: one at a time,
    # else one's os.replace finds the other's tmp file gone and the handler dies without answering.
    out = os.environ.get("WEIGHTS_BENCH_DIR")
    if out:
        path = os.path.join(out, f"engine-{os.getpid()}.json")
        with _RECORDING:
            with open(path + ".tmp", "w") as fh:
                json.dump(dict(TIMES), fh)  # a copy: the other thread may add a key meanwhile
            os.replace(path + ".tmp", path)


class Health(BaseHTTPRequestHandler):
    ready = threading.Event()

    def do_GET(self) -> None:
        code = (200 if self.ready.is_set() else 503) if self.path == "/health" else 404
        if code == 200 and "t_first_200" not in TIMES:
            TIMES["t_first_200"] = time.monotonic()
            record()
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        """POST /v1/completions: one token in vLLM 0.32's shape, streamed (then [DONE]) when the body asks for a
        stream: the front's failover is timed to a new request's first token, and the supervisor's canary wants a
        whole answer with a choice."""
        length = int(self.headers.get("Content-Length") or 0)
        try:
            stream = json.loads(self.rfile.read(length) or b"{}").get("stream") is True
        except (ValueError, AttributeError):
            stream = False
        if self.path != "/v1/completions" or not self.ready.is_set():
            self.send_response(404 if self.ready.is_set() else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        chunk = {"id": f"cmpl-{os.getpid()}", "object": "text_completion", "created": int(time.time())}
        chunk |= {"model": "standin", "choices": [choice]}
        doc = json.dumps(chunk, separators=(",", ":")).encode()
        # A stream for the front's clients; the whole answer for the supervisor's canary (liveness/engine.py).
        body = b"data: " + doc + b"\n\ndata: [DONE]\n\n" if stream else doc
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        del format, args


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm serve (stand-in)")
    p.add_argument("model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--model-loader-extra-config", default="{}")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=0, dest="kv_bytes")
    p.add_argument("--uds", default=None)
    ns, _ = p.parse_known_args(list(argv))  # --dtype...: the supervisor's, not ours
    return ns


class UnixHTTPServer(ThreadingHTTPServer):
    """vLLM's API server on its --uds socket (entrypoints/launchers/launcher.py binds the path as it is)."""

    address_family = socket.AF_UNIX

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: no host name to look up for a path
        self.server_name, self.server_port = "localhost", 0


def request_memory(ns: argparse.Namespace) -> None:
    """vLLM's start-up memory rule for mapped weights (v1/worker/utils.py:716-768 request_memory): on each GPU,
    free >= ceil(total x util) - what the daemon's allocator holds (its get_memory answer, ipc_loader.py:121-165),
    else vLLM's ValueError, so the scene checks the supervisor's preflight against the same rule."""
    import math

    import torch

    extra = json.loads(ns.model_loader_extra_config)
    for rank in range(ns.tp):
        with connect(rank_socket(extra["socket_dir"], rank), 2.0) as sock:
            send_msg(sock, {"cmd": "get_memory"})
            answer = recv_msg(sock)
        if answer.get("status") != "ok":
            raise SystemExit(f"Weight cache daemon rejected the memory query: {answer.get('message')}")
        external = int(answer["memory_bytes"])
        free, total = torch.cuda.mem_get_info(rank)
        engine_memory = math.ceil(total * ns.gpu_memory_utilization) - external
        if free < engine_memory:
            raise SystemExit(
                f"ValueError: Free memory on device cuda:{rank} ({free / GIB:.2f}/{total / GIB:.2f} GiB) on startup "
                "is less than the engine's budget after excluding external process's weights "
                f"({ns.gpu_memory_utilization}, {engine_memory / GIB:.2f} GiB)."
            )
        say(
            f"Weights are held outside this process: {external / GIB:.2f} GiB externally held, "
            f"{engine_memory / GIB:.2f} GiB for the engine",
            "utils.py:750",
        )


def map_from_holder(ns: argparse.Namespace, want: int) -> list[Any]:
    extra = json.loads(ns.model_loader_extra_config)
    held = []
    for rank in range(ns.tp):
        try:
            sock = connect(rank_socket(extra["socket_dir"], rank), 2.0)
        except OSError as err:
            if extra.get("fallback", True):
                raise SystemExit("fallback to a disk load is not in this stand-in") from err
            raise SystemExit(f"ipc_cache: no weight cache daemon for rank {rank} ({err}) and fallback is off") from err
        with sock:
            send_msg(sock, {"cmd": "get_state"})
            msg = recv_msg(sock)
        if msg.get("status") != "ok":
            raise SystemExit(f"ipc_cache: rank {rank}: the weight cache daemon answered {msg}")
        rebuild, args = msg["handle"]
        tensor = rebuild(*args)  # cudaIpcOpenMemHandle: the holder's bytes, not a copy
        got = gpu_checksum(tensor)
        if got != msg["checksum"] or got != want:
            raise SystemExit(f"rank {rank}: mapped checksum {got}, holder says {msg['checksum']}, file {want}")
        held.append(tensor)
    return held


def main(argv: Sequence[str]) -> int:
    ns = parse(argv)
    set_comm("vllm-serve")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    say(f"vLLM API server version 0.32.0 (stand-in), model {ns.model}", "utils.py:326")
    if not fake():
        import torch

        torch.cuda.init()
    TIMES["t_torch"] = time.monotonic()
    want = read_meta(ns.model)["checksum"]
    t0 = time.monotonic()
    if ns.load_format == "ipc_cache":
        if not fake():
            request_memory(ns)
        held = map_from_holder(ns, want)
        TIMES["mode"] = "ipc_cache (mapped)"
        TIMES["direct"] = None
    else:
        held = []
        for rank in range(ns.tp):
            tensor, res = load_to_gpu(os.path.join(ns.model, WEIGHTS_FILE), rank)
            if res.checksum != want:
                raise SystemExit(f"rank {rank}: loaded checksum {res.checksum} != {want}")
            held.append(tensor)
            TIMES["direct"] = res.direct
        TIMES["mode"] = "disk"
    if not fake():
        torch.cuda.synchronize()
    TIMES["t_weights"] = time.monotonic()
    TIMES["weights_s"] = TIMES["t_weights"] - t0
    TIMES["bytes"] = sum(len(t) if isinstance(t, bytes) else int(t.numel()) for t in held)
    TIMES["checksum_ok"] = True
    gib = TIMES["bytes"] / (1 << 30)
    say(f"Loading weights took {TIMES['weights_s']:.2f} seconds", "default_loader.py:501", "Worker")
    say(f"Model loading took {gib:.4f} GiB memory and {TIMES['weights_s']:.6f} seconds", "gpu_model_runner.py:1")
    kv = []
    if ns.kv_bytes and not fake():  # its own KV cache on each GPU, beside the mapped weights
        kv = [torch.empty(ns.kv_bytes, dtype=torch.uint8, device=f"cuda:{rank}") for rank in range(ns.tp)]
        torch.cuda.synchronize()
    TIMES["kv_bytes"] = ns.kv_bytes * len(kv)
    httpd: ThreadingHTTPServer = (
        UnixHTTPServer(ns.uds, Health) if ns.uds else ThreadingHTTPServer((ns.host, ns.port), Health)
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    say(f"Starting vLLM server on {ns.uds or f'http://{ns.host}:{ns.port}'}", "entry.py:140")
    say("Available routes are:", "launcher.py:186")
    # Able to answer 200 before the line says so, as vLLM's server is once uvicorn prints it: a reader that
    # probes at the line (the supervisor's burst, tests/test_weights_standins.py) never meets a 503 of the stand-in's.
    Health.ready.set()
    TIMES["t_health_able"] = time.monotonic()
    sys.stdout.write("INFO:     Application startup complete.\n")
    sys.stdout.flush()
    record()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
