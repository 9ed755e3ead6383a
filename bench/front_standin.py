"""bench_front.py --engine standin: the front's own limits, where the CPU is not shared (see bench_front.py).

Processes and cores (os.sched_setaffinity, disjoint): the engine stand-in (testkit/fakes/stream_engine.py) on
one core, the front (the real CLI, `kimi-supervisor --config NAME.front.toml`) on one core (it is one asyncio
loop), and up to four load-client processes, one core each, which carry the streams between them.  The same
pinning holds in the direct runs (clients on the stand-in's socket) and the front runs (clients on the front's
TCP port), which alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Row, table  # noqa: E402
from testkit.harness import write_config  # noqa: E402
from testkit.procutil import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "front_h200.md"
BOUND_S = 120.0  # every wait for a process to come up
CLIENTS_MAX = 4


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _session(target: tuple[str, str]) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=1800)
    if target[0] == "unix":
        return aiohttp.ClientSession(
            "http://engine", connector=aiohttp.UnixConnector(target[1], limit=0), timeout=timeout
        )
    return aiohttp.ClientSession(target[1], connector=aiohttp.TCPConnector(limit=0), timeout=timeout)


async def _one_stream(client: aiohttp.ClientSession, i: int, max_tokens: int) -> int:
    body = {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    tokens = 0
    async with client.post("/v1/completions", json=body) as answer:
        assert answer.status == 200, answer.status
        buf = b""
        async for piece in answer.content.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            tokens += sum(1 for e in events if e.startswith(b"data: {"))
    assert tokens == max_tokens, (tokens, max_tokens)
    return tokens


async def _client_loop(conn: Connection, targets: dict[str, tuple[str, str]]) -> None:
    sessions = {name: _session(target) for name, target in targets.items()}
    try:
        while True:
            command = conn.recv()
            if command[0] == "quit":
                return
            if command[0] == "short":  # ("short", n): alternate direct and front, n each
                body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
                took: dict[str, list[float]] = {"direct": [], "front": []}
                for i in range(command[1]):
                    order = ("direct", "front") if i % 2 else ("front", "direct")
                    for name in order:
                        start = time.perf_counter()
                        async with sessions[name].post("/v1/completions", json=body) as answer:
                            await answer.read()
                            assert answer.status == 200
                        took[name].append((time.perf_counter() - start) * 1000)
                conn.send(took)
                continue
            _, name, first, count, max_tokens = command  # ("streams", target, first index, count, max_tokens)
            conn.send("ready")
            conn.recv()  # go: every client starts at once
            start = time.perf_counter()
            tokens = await asyncio.gather(*(_one_stream(sessions[name], first + i, max_tokens) for i in range(count)))
            conn.send((start, time.perf_counter(), sum(tokens)))
    finally:
        for session in sessions.values():
            await session.close()


def _client(conn: Connection, core: int, targets: dict[str, tuple[str, str]]) -> None:
    os.sched_setaffinity(0, {core})
    asyncio.run(_client_loop(conn, targets))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _get(port: int | None, sock: str | None, path: str) -> bytes | None:
    """GET PATH on 127.0.0.1:PORT or the Unix socket SOCK: the body of a 200, else None (stdlib: no curl there)."""
    try:
        with socket.socket(socket.AF_UNIX if sock else socket.AF_INET) as conn:
            conn.settimeout(2)
            conn.connect(sock if sock else ("127.0.0.1", port))
            conn.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
                piece = conn.recv(65536)
                if not piece:
                    break
                answer += piece
    except OSError:
        return None
    head, _, body = answer.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else None


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30  # no length: read to the end


def _wait_http(port: int | None, sock: str | None, path: str, ok: Any) -> None:
    deadline = time.monotonic() + BOUND_S
    while True:
        body = _get(port, sock, path)
        if body is not None and ok(body):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_front: {path} on {sock or port} did not answer 200 within {BOUND_S:.0f}s")
        time.sleep(0.05)  # polling an HTTP answer: no event to wait on across processes


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.max_tokens = args.max_tokens or 1000
        cores = sorted(os.sched_getaffinity(0))
        self.disjoint = len(cores) >= 3
        self.engine_core = cores[0]
        self.front_core = cores[1 % len(cores)]
        spare = cores[2:] if self.disjoint else cores
        self.client_cores = spare[:CLIENTS_MAX]
        self.work = Path(tempfile.mkdtemp(prefix="kbfs-", dir="/tmp"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.starts = 0

    def _spawn(
        self, argv: list[str], core: int, log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.work / log).open("wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)
        self.procs.append(proc)
        os.sched_setaffinity(proc.pid, {core})
        return proc

    def start(self, pace: float, port: int) -> tuple[int, int, str]:
        """The stand-in (unpaced or paced) and a front before it; their pids and the engine's socket."""
        self.starts += 1
        runtime = self.work / f"run{self.starts}"
        sock = runtime / "kimi-b" / "front" / "engine.sock"
        sock.parent.mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        engine = self._spawn(
            [sys.executable, "-m", "testkit.fakes.stream_engine", "--socket", str(sock), "--pace-tok-s", str(pace)],
            self.engine_core,
            f"engine{self.starts}.log",
            env,
        )
        config = write_config(
            self.work / f"kimi-b{self.starts}.front.toml",
            {
                "deployment": {"name": "kimi-b", "role": "front"},
                "front": {"host": "127.0.0.1", "port": port},
                "paths": {"runtime_directory": str(runtime), "state_directory": str(self.work / "state")},
            },
        )
        front = self._spawn(
            [sys.executable, "-m", "kimi_supervisor", "--config", str(config)],
            self.front_core,
            f"front{self.starts}.log",
            env,
        )
        _wait_http(None, str(sock), "/health", lambda _: True)
        _wait_http(port, None, "/front/health", lambda out: json.loads(out).get("engine_serving") is True)
        return engine.pid, front.pid, str(sock)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)
        self.procs.clear()

    def clients(self, targets: dict[str, tuple[str, str]]) -> list[tuple[Connection, Any]]:
        ctx = multiprocessing.get_context("spawn")
        out = []
        for core in self.client_cores:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(theirs, core, targets), daemon=True)
            proc.start()
            out.append((mine, proc))
        return out

    def streams(self, clients: list[tuple[Connection, Any]], name: str, front_pid: int) -> dict[str, float]:
        """One run of args.streams streams split over the clients; tokens/s, and the front's CPU and peak RSS."""
        count = self.args.streams
        share = [count // len(clients) + (1 if i < count % len(clients) else 0) for i in range(len(clients))]
        first = 0
        for (conn, _), n in zip(clients, share, strict=True):
            conn.send(("streams", name, first, n, self.max_tokens))
            first += n
        for conn, _ in clients:
            assert conn.recv() == "ready"
        cpu0 = _cpu_s(front_pid)
        for conn, _ in clients:
            conn.send("go")
        peak = _rss(front_pid)
        results = []
        for conn, _ in clients:
            while not conn.poll(0.1):
                peak = max(peak, _rss(front_pid))
            results.append(conn.recv())
        peak = max(peak, _rss(front_pid))
        cpu = _cpu_s(front_pid) - cpu0
        tokens = sum(r[2] for r in results)
        span = max(r[1] for r in results) - min(r[0] for r in results)
        return {"tok_s": tokens / span, "tokens": tokens, "front_cpu_s": cpu, "rss": peak}

    def measure(self, pace: float, short: bool) -> dict[str, Any]:
        port = free_port()
        _, front_pid, sock = self.start(pace, port)
        targets = {"direct": ("unix", sock), "front": ("tcp", f"http://127.0.0.1:{port}")}
        clients = self.clients(targets)
        try:
            out: dict[str, Any] = {}
            if short:
                conn = clients[0][0]
                conn.send(("short", 20))  # warm-up, left out
                conn.recv()
                conn.send(("short", self.args.requests))
                out["short"] = conn.recv()
            runs: dict[str, list[dict[str, float]]] = {"direct": [], "front": []}
            self.streams(clients, "front", front_pid)  # warm-up: connections, the front's first allocations
            for i in range(self.args.rounds):
                for name in ("direct", "front") if i % 2 == 0 else ("front", "direct"):
                    runs[name].append(self.streams(clients, name, front_pid))
            out["runs"] = runs
            return out
        finally:
            for conn, proc in clients:
                conn.send(("quit",))
                proc.join(15)
            self.stop()


def _ratio(result: dict[str, Any]) -> tuple[float, list[float], list[float]]:
    direct = [r["tok_s"] for r in result["runs"]["direct"]]
    front = [r["tok_s"] for r in result["runs"]["front"]]
    return statistics.median(front) / statistics.median(direct), direct, front


def _cpu_per_1k(result: dict[str, Any]) -> float:
    runs = result["runs"]["front"]
    return 1e6 * sum(r["front_cpu_s"] for r in runs) / sum(r["tokens"] for r in runs)


def rows(results: dict[str, dict[str, Any]], args: argparse.Namespace, max_tokens: int) -> list[Row]:
    """RESULTS: "unpaced" (with the short requests) and "paced"."""
    out = []
    for kind, result in results.items():
        streams = f"{args.streams} streams x {max_tokens if kind == 'unpaced' else args.paced_tokens} tokens"
        if "short" in result:
            short = result["short"]
            added50 = pct(short["front"], 0.5) - pct(short["direct"], 0.5)
            added99 = pct(short["front"], 0.99) - pct(short["direct"], 0.99)
            n = len(short["front"])
            out.append(
                Row(
                    f"added latency, short non-streamed request (max_tokens 1), p50, n={n} each, alternated",
                    "p50 <= 1 ms",
                    f"{added50:+.3f} ms ({pct(short['direct'], 0.5):.3f} -> {pct(short['front'], 0.5):.3f} ms)",
                    added50 <= 1.0,
                )
            )
            out.append(
                Row(
                    "same, p99",
                    "-",
                    f"{added99:+.3f} ms ({pct(short['direct'], 0.99):.3f} -> {pct(short['front'], 0.99):.3f} ms)",
                    None,
                )
            )
        ratio, direct, front = _ratio(result)
        pace = "unpaced: as fast as CPU allows" if kind == "unpaced" else f"paced: {args.pace_tok_s:g} tok/s per stream"
        # Unpaced, the stand-in outruns any proxy in one Python process: that row is the front's ceiling, to read
        # against the paced load, not a target it could meet (a row that always fails would say nothing).
        paced = kind != "unpaced"
        out.append(
            Row(
                f"{streams}, {pace}; tokens/s front vs direct, {args.rounds} runs each, alternated",
                ">= 0.98x direct" if paced else "- (the front's ceiling)",
                f"{ratio:.3f}x (direct {', '.join(f'{r:.0f}' for r in direct)}; "
                f"front {', '.join(f'{r:.0f}' for r in front)})",
                ratio >= 0.98 if paced else None,
            )
        )
        rss = max(r["rss"] for r in result["runs"]["front"]) / (1 << 20)
        out.append(
            Row(
                f"the front's CPU per 1000 streamed tokens, and its peak RSS ({kind})",
                "-",
                f"{_cpu_per_1k(result):.1f} ms CPU; {rss:.1f} MiB",
                None,
            )
        )
    return out


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main(args: argparse.Namespace) -> int:
    bench = Bench(args)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    try:
        results["unpaced"] = bench.measure(0.0, short=True)
        bench.max_tokens, unpaced_tokens = args.paced_tokens, bench.max_tokens
        results["paced"] = bench.measure(args.pace_tok_s, short=False)
        bench.max_tokens = unpaced_tokens
    finally:
        bench.stop()
        shutil.rmtree(bench.work, ignore_errors=True)
    result = rows(results, args, bench.max_tokens)
    facts = [
        f"- command: `{' '.join(['python3', 'bench/bench_front.py', *sys.argv[1:]])}` (from the repository root), "
        f"{time.monotonic() - started:.0f} s in all",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: nproc {os.cpu_count()}, {cpu_model()}, Linux {platform.release()}; "
        f"python {platform.python_version()}, aiohttp {aiohttp.__version__}",
        f"- cores: stand-in {bench.engine_core}, front {bench.front_core}, clients {bench.client_cores} "
        + ("(disjoint)" if bench.disjoint else "(NOT disjoint: fewer than 3 cores)"),
        f"- {bench.max_tokens} tokens per stream unpaced, {args.paced_tokens} paced; direct = the clients on the "
        "stand-in's Unix socket, front = loopback TCP to the front, then the socket",
    ]
    text = "# The front's own limits (engine stand-in)\n\n" + "\n".join(facts) + "\n\n" + table(result) + "\n"
    out: Path = args.out or RESULTS
    out.write_text(text)
    print(text)
    return 1 if any(r.ok is False for r in result) else 0
