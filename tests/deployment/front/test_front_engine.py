"""The front's engines (kimi_supervisor/deployment/front/engine.py) and the gate that waits for them (gate.py): with
two engines, as a hot spare would make it, a request goes to the one that serves, the preferred one first; the
pool serves while any engine does, and a held request goes on as soon as any serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kimi_supervisor.deployment.front.engine import Engine, EnginePool
from kimi_supervisor.deployment.front.gate import EngineGate, QueueFull
from kimi_supervisor.deployment.front.records import EngineRecords
from tests.deployment.front.harness import BOUND_S, until

pytest.importorskip("aiohttp")


def _two() -> tuple[Engine, Engine, EnginePool, list[bool]]:
    main = Engine("main", Path("/nonexistent/main.sock"), 1.0, EngineRecords())
    spare = Engine("spare", Path("/nonexistent/spare.sock"), 1.0, EngineRecords())
    pool = EnginePool([main, spare])
    changes: list[bool] = []
    pool.on_change = changes.append
    return main, spare, pool, changes


def test_a_request_goes_to_the_engine_that_serves_the_preferred_one_first() -> None:
    main, spare, pool, changes = _two()
    assert not pool.serving and pool.pick() is main  # none serves: the main one, which the hold let through
    pool.mark(spare, True)
    assert pool.serving and pool.pick() is spare
    pool.mark(main, True)
    assert pool.pick() is main  # both serve: the preferred one
    pool.broke(main)
    assert pool.serving and pool.pick() is spare and pool.probe_now.is_set()
    pool.mark(spare, False)
    assert not pool.serving and pool.pick() is main
    # The pool's own answer changed twice (some serves, none does): an outage is the pool's, not each engine's.
    assert changes == [True, False]


def test_the_soonest_eta_of_the_engines_is_the_pools() -> None:
    main, spare, pool, _changes = _two()
    assert pool.eta_s is None
    spare.eta_s = 40.0
    assert pool.eta_s == 40.0
    main.eta_s = 12.5
    assert pool.eta_s == 12.5


def test_a_held_request_goes_on_once_any_engine_serves() -> None:
    async def scenario() -> None:
        _main, spare, pool, _changes = _two()
        gate = EngineGate(pool, queue_max=1, hold_s=BOUND_S)
        held = asyncio.ensure_future(gate.wait())
        await until(lambda: gate.held == 1, "the request is held")
        assert not held.done()
        with pytest.raises(QueueFull):
            await gate.wait()
        pool.mark(spare, True)
        assert await asyncio.wait_for(held, BOUND_S)
        assert gate.held == 0
        assert await gate.wait()  # one serves: at once, without waiting in the queue

    asyncio.run(scenario())


def test_a_held_request_is_turned_away_after_hold_s_and_retry_after_is_the_eta() -> None:
    async def scenario() -> None:
        main, _spare, pool, _changes = _two()
        gate = EngineGate(pool, queue_max=4, hold_s=0.05)
        assert not await gate.wait()
        assert gate.held == 0 and gate.retry_after_s() == 1
        main.eta_s = 41.2
        assert gate.retry_after_s() == 42

    asyncio.run(scenario())
