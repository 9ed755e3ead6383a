"""The one decision "the engine failed under this request" (kimi_supervisor/deployment/front/failure.py), against a
stand-in engine on a Unix socket: a refused or reset connection is always the engine's; a 5xx answer and vLLM's
error chunk are the engine's only while its /health fails, the request's own while it answers.  The engine the
verdict names stops serving in the pool, and the watch is asked to probe it at once."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kimi_supervisor.deployment.front.engine import BASE, Engine, EnginePool
from kimi_supervisor.deployment.front.failure import EngineBroke, Failures
from kimi_supervisor.deployment.front.records import EngineRecords
from tests.deployment.front.fake_engine import FakeEngine
from tests.deployment.front.harness import BOUND_S, run

pytest.importorskip("aiohttp")

ERROR_CHUNK = b'{"error": {"message": "EngineDeadError", "type": "InternalServerError", "code": 500}}'
TOKEN_CHUNK = b'{"id": "cmpl-7", "choices": [{"index": 0, "text": "<1>", "token_ids": [1]}]}'


@contextlib.asynccontextmanager
async def _serving(up: bool = True) -> AsyncIterator[tuple[FakeEngine, Engine, EnginePool, Failures]]:
    """A stand-in engine (listening when `up`), the front's Engine for its socket, marked serving in its pool."""
    directory = Path(tempfile.mkdtemp(prefix="kfail-", dir="/tmp"))  # a Unix socket's path is short
    fake = FakeEngine(directory / "engine.sock")
    engine = Engine("main", fake.socket, BOUND_S, EngineRecords())
    pool = EnginePool([engine])
    if up:
        await fake.start()
    engine.open()
    pool.mark(engine, True)
    try:
        yield fake, engine, pool, Failures(pool)
    finally:
        await engine.close()
        await fake.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _marked_broken(engine: Engine, pool: EnginePool) -> bool:
    return not engine.serving and not pool.serving and pool.probe_now.is_set()


@pytest.mark.parametrize("marks", [True, False], ids=["request", "monitor_probe"])
def test_a_refused_socket_is_the_engine_broken(marks: bool) -> None:
    async def scenario() -> None:
        async with _serving(up=False) as (_fake, engine, pool, failures):
            with pytest.raises(EngineBroke) as caught:
                async with failures.connection(engine, marks=marks), engine.session.get(BASE + "/v1/models"):
                    pass
            assert caught.value.why in ("ClientConnectorError", "UnixClientConnectorError")
            # A monitor's probe of /health or /metrics is answered; the engine's state is the watch's to say.
            assert _marked_broken(engine, pool) is marks
            assert engine.serving is not marks

    run(scenario)


def test_a_connection_reset_mid_answer_is_the_engine_broken() -> None:
    async def scenario() -> None:
        async with _serving() as (fake, engine, pool, failures):
            fake.hold_after_first = asyncio.Event()  # never set: the stream waits for the crash
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            with pytest.raises(EngineBroke):
                async with (
                    failures.connection(engine),
                    engine.session.post(BASE + "/v1/completions", json=body) as answer,
                ):
                    await asyncio.wait_for(answer.content.readuntil(b"\n\n"), BOUND_S)
                    await fake.crash()
                    await asyncio.wait_for(answer.read(), BOUND_S)
            assert _marked_broken(engine, pool)

    run(scenario)


def test_any_other_error_inside_is_not_the_engines() -> None:
    async def scenario() -> None:
        async with _serving() as (_fake, engine, pool, failures):
            with pytest.raises(KeyError):
                async with failures.connection(engine):
                    raise KeyError("the request's own bug")
            assert engine.serving and pool.serving and not pool.probe_now.is_set()

    run(scenario)


@pytest.mark.parametrize("status", [500, 503])
def test_a_5xx_is_the_engines_failure_only_while_its_health_fails(status: int) -> None:
    async def scenario() -> None:
        async with _serving() as (fake, engine, pool, failures):
            await failures.answer(engine, status)  # /health answers: the request's own 5xx, passed on
            assert engine.serving and not pool.probe_now.is_set()
            fake.healthy = False
            await failures.answer(engine, 404)  # not a 5xx: never the engine's
            assert engine.serving
            with pytest.raises(EngineBroke):
                await failures.answer(engine, status)
            assert _marked_broken(engine, pool)

    run(scenario)


def test_vllms_error_chunk_is_the_engines_failure_only_while_its_health_fails() -> None:
    """vLLM writes an error chunk, then [DONE], when its engine core died (EngineDeadError); an error chunk while
    /health answers is the request's own (a bad parameter found mid-stream) and reaches the client."""

    async def scenario() -> None:
        async with _serving() as (fake, engine, pool, failures):
            chunk = await failures.chunk(engine, ERROR_CHUNK)
            assert isinstance(chunk, dict) and chunk["error"]["message"] == "EngineDeadError"
            assert engine.serving
            fake.healthy = False
            assert await failures.chunk(engine, TOKEN_CHUNK) == {
                "id": "cmpl-7",
                "choices": [{"index": 0, "text": "<1>", "token_ids": [1]}],
            }
            assert engine.serving  # a token's chunk asks nothing of /health
            with pytest.raises(EngineBroke):
                await failures.chunk(engine, ERROR_CHUNK)
            assert _marked_broken(engine, pool)

    run(scenario)


def test_a_stream_cut_short_before_done_is_the_engine_broken() -> None:
    async def scenario() -> None:
        async with _serving() as (_fake, engine, pool, failures):
            assert isinstance(failures.cut_short(engine), EngineBroke)
            assert _marked_broken(engine, pool)

    run(scenario)
