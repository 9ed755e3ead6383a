"""A front and a stand-in engine on a Unix socket, both in one event loop, and a client over loopback TCP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.proxy import FrontServer
from testkit.fakes.log import RecordingLog
from tests.deployment.front.fake_engine import FakeEngine

BOUND_S = 30.0  # every wait of these tests: a bound on an event, never a pause


@dataclasses.dataclass
class Harness:
    front: FrontServer
    engine: FakeEngine
    client: aiohttp.ClientSession
    log: RecordingLog
    port: int  # the front's, on 127.0.0.1


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition of the front's or the engine's state, bounded."""
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {BOUND_S}s: {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def spare_engine() -> AsyncIterator[FakeEngine]:
    """A second stand-in engine, serving on a socket of its own (the front's hot spare)."""
    directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
    spare = FakeEngine(directory / "spare.sock")
    await spare.start()
    try:
        yield spare
    finally:
        await spare.stop()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.asynccontextmanager
async def running(engine_up: bool = True, **settings: Any) -> AsyncIterator[Harness]:
    # A short directory of its own: a Unix socket's path has at most 107 bytes, pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="kfront-", dir="/tmp"))
    engine = FakeEngine(directory / "engine.sock")
    if engine_up:
        await engine.start()
    cfg = FrontConfig(
        host="127.0.0.1",
        port=0,
        engine_socket=engine.socket,
        **{"probe_interval_s": 0.1, "engine_state_file": None, **settings},
    )
    log = RecordingLog()
    front = FrontServer(cfg, log)
    runner = front.runner()
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            if engine_up:
                await until(lambda: front.engines.serving, "the front sees the engine serving")
            yield Harness(front, engine, client, log, port)
    finally:
        await runner.cleanup()
        await engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 4 * BOUND_S))


async def stream_text(answer: aiohttp.ClientResponse) -> tuple[str, list[dict[str, Any]]]:
    """The text a client reads from a completions or chat stream, and every event's data ("[DONE]" as a str)."""
    raw = (await answer.read()).decode()
    events: list[Any] = []
    text = ""
    for block in raw.split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[6:]
        if data == "[DONE]":
            events.append(data)
            continue
        doc = json.loads(data)
        events.append(doc)
        for choice in doc.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, events


async def uninterrupted(h: Harness, path: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """The text and events of a stream that nothing breaks."""
    async with h.client.post(path, json=body) as answer:
        assert answer.status == 200
        return await stream_text(answer)


async def broken(h: Harness, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Any]:
    """The events of a stream that the engine breaks after its fifth token, the engine then back."""
    h.engine.crash_after = 5
    crashes = h.engine.crashes
    sent = asyncio.ensure_future(h.client.post(path, json=body, headers=headers))
    await until(lambda: h.engine.crashes == crashes + 1, "the engine crashed mid-stream")
    await h.engine.restart()
    async with await asyncio.wait_for(sent, BOUND_S) as answer:
        assert answer.status == 200
        _text, events = await stream_text(answer)
    return events
