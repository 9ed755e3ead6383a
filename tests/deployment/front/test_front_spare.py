"""The front with a hot spare (docs/spare.md): new requests go to the engine while it serves and to the spare while
it does not, back to the engine once it serves; the failover is counted from the engine's death to the first request
sent to the spare; the deployment without a ready spare says so, and alerts past front.spare_alert_s."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kimi_supervisor.deployment.front.engine import Engine, EnginePool, Failover
from kimi_supervisor.deployment.front.metrics import SpareReadiness
from kimi_supervisor.deployment.front.records import EngineRecords
from kimi_supervisor.opsview.statefile import process_start_time
from tests.deployment.front.fake_engine import FakeEngine
from tests.deployment.front.harness import BOUND_S, run, running, spare_engine, stream_text, until

pytest.importorskip("aiohttp")


class Ticks:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failover_lasts_from_the_engines_death_to_the_first_request_sent_to_the_spare() -> None:
    clock = Ticks()
    main = Engine("main", Path("/nonexistent/main.sock"), 1.0, EngineRecords())
    spare = Engine("spare", Path("/nonexistent/spare.sock"), 1.0, EngineRecords())
    pool = EnginePool([main, spare], clock=clock)
    seen: list[Failover] = []
    pool.on_failover = seen.append
    pool.mark(main, True)
    pool.mark(spare, True)
    assert pool.pick() is main and pool.serving_engine is main and pool.spares == [spare]
    pool.broke(main)  # the engine died under a request at 100.0
    clock.now = 100.25
    assert pool.pick() is spare and pool.pick() is spare
    assert seen == [Failover("main", "spare", 0.25)]  # once: the first request sent to the spare ends it
    pool.mark(main, True)  # the engine serves again: new requests go back to it, no failover counted for that
    assert pool.pick() is main and len(seen) == 1
    # Back before any request went elsewhere: nothing failed over.
    pool.mark(main, False)
    pool.mark(main, True)
    assert pool.pick() is main and len(seen) == 1
    # The spare alone dies while the engine serves: no request moves, nothing counted.
    pool.mark(spare, False)
    assert pool.pick() is main and len(seen) == 1


def test_a_pool_of_one_engine_counts_no_failover() -> None:
    main = Engine("main", Path("/nonexistent/main.sock"), 1.0, EngineRecords())
    pool = EnginePool([main])
    seen: list[Failover] = []
    pool.on_failover = seen.append
    pool.mark(main, True)
    pool.mark(main, False)
    pool.mark(main, True)
    assert pool.pick() is main and seen == [] and pool.spares == []


def test_the_alert_fires_once_the_deployment_ran_without_a_ready_spare_past_its_bound() -> None:
    readiness = SpareReadiness(alert_s=600.0)
    assert not readiness.update(False, 0.0) and readiness.without_s(0.0) == 0.0
    assert not readiness.update(False, 600.0) and not readiness.alerting(600.0)
    assert readiness.update(False, 600.5) and readiness.alerting(600.5)  # crossed: logged once
    assert not readiness.update(False, 900.0) and readiness.alerting(900.0)
    assert not readiness.update(True, 901.0) and readiness.without_s(901.0) == 0.0 and not readiness.alerting(901.0)
    assert not readiness.update(False, 950.0) and readiness.without_s(1000.0) == 50.0


def test_with_the_engine_down_a_new_request_goes_to_the_spare_at_once_and_back_once_the_engine_serves() -> None:
    async def scenario() -> None:
        directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
        spare = FakeEngine(directory / "spare.sock")
        await spare.start()
        try:
            async with running(spare_socket=spare.socket, spare_alert_s=600.0) as h:
                engines = h.front.engines
                await until(lambda: all(e.serving for e in engines.engines), "both engines serve")
                assert h.front.watch.headline().endswith("(spare ready)")
                body = {"prompt": "a", "max_tokens": 2}
                async with h.client.post("/v1/completions", json=body) as answer:
                    assert answer.status == 200
                assert [p for p, _ in h.engine.seen] == ["/v1/completions"] and spare.seen == []
                await h.engine.crash()
                await until(lambda: not engines.main.serving, "the front sees the engine down")
                assert engines.serving and h.front.watch.headline().startswith("serving: engine down, spare serving")
                async with h.client.post("/v1/completions", json=body) as answer:
                    assert answer.status == 200
                assert [p for p, _ in spare.seen] == ["/v1/completions"]
                counts = h.front.metrics.counts
                assert counts["held"] == 0 and counts["forwarded"] == 2  # nobody waited for the engine's restart
                [failover] = h.front.metrics.failovers_seen
                assert (failover["died"], failover["to"]) == ("main", "spare")
                scraped = h.front.metrics.text().decode()
                assert 'kimi_front_serving_engine{deployment="kimi-supervisor",engine="spare"} 1.0' in scraped
                assert 'kimi_front_failovers_total{deployment="kimi-supervisor",to="spare"} 1.0' in scraped
                assert 'kimi_front_spare_ready{deployment="kimi-supervisor"} 1.0' in scraped
                await h.engine.restart()
                await until(lambda: engines.main.serving, "the engine serves again")
                async with h.client.post("/v1/completions", json=body) as answer:
                    assert answer.status == 200
                assert len(h.engine.seen) == 2 and len(spare.seen) == 1  # new requests back to the engine
                assert len(h.front.metrics.failovers_seen) == 1
        finally:
            await spare.stop()
            shutil.rmtree(directory, ignore_errors=True)

    run(scenario)


def test_without_a_ready_spare_the_front_holds_as_before_and_says_so() -> None:
    async def scenario() -> None:
        directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
        try:
            async with running(spare_socket=directory / "spare.sock", spare_alert_s=0.05) as h:
                await until(lambda: bool(h.log.events("front.no_ready_spare")), "the alert is logged")
                assert "no ready spare for" in h.front.watch.headline()
                assert 'kimi_front_no_ready_spare_alert{deployment="kimi-supervisor"} 1.0' in (
                    h.front.metrics.text().decode()
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    run(scenario)


def test_a_stream_broken_by_the_engines_crash_resumes_on_the_spare_at_once_with_the_uninterrupted_text() -> None:
    """streams.py unchanged: its resume waits for any engine to serve and picks the one that does, the spare."""

    async def scenario() -> None:
        directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
        spare = FakeEngine(directory / "spare.sock")
        spare.fingerprint = "vllm-0.32.0-tp8-5pa4e000"
        await spare.start()
        body = {"prompt": "tell", "max_tokens": 12, "stream": True}
        try:
            async with running(spare_socket=spare.socket, hold_s=BOUND_S) as h:
                await until(lambda: all(e.serving for e in h.front.engines.engines), "both engines serve")
                async with h.client.post("/v1/completions", json=body) as answer:
                    want, _ = await stream_text(answer)
                h.engine.crash_after = 5
                async with h.client.post("/v1/completions", json=body) as answer:
                    assert answer.status == 200
                    text, events = await stream_text(answer)
                assert h.engine.crashes == 1 and text == want  # the engine stays down: the spare finished it
                # The one-token request that shows how the spare ends a stream (facts.py), its render, the derender
                # call that says which ids are bytes of an unfinished character, the /detokenize that says the ids
                # sent end whole, its generate.
                paths = ["/v1/completions", "/v1/completions/render", "/v1/completions/derender", "/detokenize"]
                paths.append("/inference/v1/generate")
                assert [p for p, _ in spare.seen] == paths
                assert not any("error" in e for e in events if isinstance(e, dict))
                # The engine that finished the stream is the one its fingerprint names.
                ends = [e.get("system_fingerprint") for e in events if isinstance(e, dict)]
                assert ends[-1] == spare.fingerprint and not any(ends[:-1])
                assert h.front.metrics.counts["resumed"] == 1 and h.front.metrics.counts["held"] == 0
                assert [(f["died"], f["to"]) for f in h.front.metrics.failovers_seen] == [("main", "spare")]
        finally:
            await spare.stop()
            shutil.rmtree(directory, ignore_errors=True)

    run(scenario)


def test_a_planned_restart_of_the_engine_sends_new_requests_to_the_spare_meanwhile(tmp_path: Path) -> None:
    """The engine's supervisor drains it (state file `stopping`, /health still 200): new requests go to the spare,
    none waits; once the engine's supervisor says `ready` again, they go back to the engine."""
    state = tmp_path / "state.json"
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "version": "t", "config": "x"}

    def phase(name: str) -> None:
        state.write_text(json.dumps({"schema": 1, "supervisor": me, "phase": name}))

    async def scenario() -> None:
        directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
        spare = FakeEngine(directory / "spare.sock")
        await spare.start()
        body = {"prompt": "a", "max_tokens": 2}
        phase("ready")
        try:
            async with running(spare_socket=spare.socket, engine_state_file=state) as h:
                await until(lambda: all(e.serving for e in h.front.engines.engines), "both engines serve")
                phase("stopping")
                await until(lambda: not h.front.engines.main.serving, "the front sees the engine draining")
                for _ in range(3):
                    async with h.client.post("/v1/completions", json=body) as answer:
                        assert answer.status == 200
                assert h.engine.seen == [] and len(spare.seen) == 3 and h.front.metrics.counts["held"] == 0
                phase("ready")
                await until(lambda: h.front.engines.main.serving, "the engine serves again")
                async with h.client.post("/v1/completions", json=body) as answer:
                    assert answer.status == 200
                assert len(h.engine.seen) == 1 and len(spare.seen) == 3
        finally:
            await spare.stop()
            shutil.rmtree(directory, ignore_errors=True)

    run(scenario)


def test_a_spare_whose_tokens_key_is_not_the_engines_gets_no_request(tmp_path: Path) -> None:
    """The engine restarted with an edited argv while the spare runs its old one: their recorded output keys differ,
    so the front sends the spare nothing (and says why once) until the spare's unit restarts it with the new one."""
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "version": "t", "config": "x"}

    def record(path: Path, key: str) -> None:
        path.write_text(json.dumps({"schema": 1, "supervisor": me, "phase": "ready", "output_key": key}))

    engine_state, spare_state = tmp_path / "state.json", tmp_path / "state.spare.json"
    record(engine_state, "a" * 64)
    record(spare_state, "b" * 64)

    async def scenario() -> None:
        directory = Path(tempfile.mkdtemp(prefix="kspare-", dir="/tmp"))
        spare = FakeEngine(directory / "spare.sock")
        await spare.start()
        try:
            settings = {
                "spare_socket": spare.socket,
                "engine_state_file": engine_state,
                "spare_state_file": spare_state,
            }
            async with running(**settings) as h:  # type: ignore[arg-type]
                await until(lambda: bool(h.log.events("front.spare_stale")), "the stale spare is named")
                assert not h.front.engines.spares[0].serving
                await h.engine.crash()
                await until(lambda: not h.front.engines.serving, "no engine serves: the stale spare is not one")
                record(spare_state, "a" * 64)  # the spare restarted on the engine's argv
                await until(lambda: h.front.engines.spares[0].serving, "the spare serves")
                async with h.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}) as answer:
                    assert answer.status == 200
                assert len(spare.seen) == 1 and len(h.log.events("front.spare_stale")) == 1
        finally:
            await spare.stop()
            shutil.rmtree(directory, ignore_errors=True)

    run(scenario)


def test_a_stream_on_an_engine_whose_health_says_dead_is_cut_and_resumed_on_the_spare_at_once() -> None:
    """Was: a stream on an engine whose EngineCore died waited until vLLM's API server ended it (1.9 s p50 after
    the kill with real vLLM, bench/results/spare_vllm.md) although /health said 503 at once."""

    async def scenario() -> None:
        body = {"prompt": "tell", "max_tokens": 12, "stream": True}
        async with spare_engine() as spare, running(spare_socket=spare.socket, hold_s=BOUND_S) as h:
            await until(lambda: all(e.serving for e in h.front.engines.engines), "both engines serve")
            async with h.client.post("/v1/completions", json=body) as answer:
                want, _ = await stream_text(answer)
            # The engine's connection stays open and silent after the first token: its EngineCore is dead,
            # its API server (this connection) does not know it yet; its /health does.
            stalled = h.engine.hold_after_first = asyncio.Event()
            sent = asyncio.ensure_future(h.client.post("/v1/completions", json=body))
            await until(lambda: len(h.engine.seen) == 2, "the stream reached the engine")
            h.engine.healthy = False
            try:
                async with await asyncio.wait_for(sent, BOUND_S) as answer:
                    text, events = await asyncio.wait_for(stream_text(answer), BOUND_S)
            finally:
                stalled.set()
            assert text == want and not any("error" in e for e in events if isinstance(e, dict))
            assert h.front.metrics.counts["resumed"] == 1 and h.engine.crashes == 0
            assert "/inference/v1/generate" in [p for p, _ in spare.seen]

    run(scenario)
