"""The engines the front forwards to (docs/front.md), and which of them serves now.

An `Engine` is one upstream: HTTP over its Unix socket (vLLM's --uds) through aiohttp's client, its /health probe,
its records (records.py) and whether it serves.  The `EnginePool` lists them, the preferred first, and answers
"which engine serves now" and "does any": a request goes to the first that serves, and the gate (gate.py) waits
until any does.  The list holds the engine FrontConfig names and, with `front.spare = true`, its hot spare
(docs/spare.md) after it: one more entry, not another code path.  New requests go to the engine while it serves and
to the spare while it does not; once the engine serves again new requests go back to it, and what the spare serves
finishes there.  The pool counts each failover: the time from an engine's death (the moment it stopped serving) to
the first request sent to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp

from kimi_supervisor.deployment.front.facts import EngineFacts
from kimi_supervisor.deployment.front.records import EngineRecords

# What a broken engine connection raises: refused or missing socket, reset, a body cut short.
BROKEN = (aiohttp.ClientError, ConnectionError, OSError)
BASE = "http://engine"  # the host is the socket: this name only fills the request line's Host
# The engine supervisor's phases in which new requests wait: it is draining, or not up yet.
HOLDING_PHASES = frozenset({"preflight", "starting", "stopping", "stopped", "failed"})


class Engine:
    def __init__(self, name: str, socket: Path, probe_timeout_s: float, records: EngineRecords) -> None:
        self.name = name  # for logs: "main" for the one FrontConfig names
        self.socket = socket
        self.records = records
        self.serving = False  # as the last probe, or a request that saw it break, left it (EnginePool.mark)
        self.eta_s: float | None = None  # its load's ETA, as its supervisor's state file last said
        # What it ends a stream with, by stream kind (facts.py): learned once while it serves, forgotten when it
        # stops (a restart may bring another config, so another fingerprint).
        self.facts: dict[str, asyncio.Future[EngineFacts]] = {}
        self._streams: set[aiohttp.ClientResponse] = set()  # its answers streamed to clients now (streams.py)
        self._probe_timeout_s = probe_timeout_s
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """The client session, made inside the running loop (aiohttp binds a session to its loop)."""
        # No pool limit (vLLM queues requests itself), no decompression (bytes pass through as they are), no
        # total timeout (a stream lasts as long as it generates); connecting is bounded by the probe's timeout.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self.socket), limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._probe_timeout_s),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the engine's session is not open"
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def healthy(self) -> bool:
        """GET /health answered 200 within the probe's timeout.  An answer that is not 200, or a refused
        connection, says the engine is gone: vLLM 0.32 answers 503 as soon as its EngineCore is dead (a draining
        engine answers 200), so the streams still open on it will get no token more, and they are cut now
        (`cut_streams`: each resumes where an engine serves) rather than when vLLM's API server ends them, 1.9 s
        after the kill (p50, bench/results/spare_vllm.md).  A timeout says nothing so sure: it cuts nothing."""
        try:
            async with self.session.get(BASE + "/health", timeout=self._probe_timeout) as answer:
                await answer.read()
                ok = answer.status == 200
        except asyncio.TimeoutError:
            return False
        except BROKEN:
            ok = False
        if not ok:
            self.cut_streams()
        return ok

    @contextlib.contextmanager
    def streaming(self, answer: aiohttp.ClientResponse) -> Iterator[None]:
        """While the block runs, `answer` is one of this engine's streams that `cut_streams` ends."""
        self._streams.add(answer)
        try:
            yield
        finally:
            self._streams.discard(answer)

    def cut_streams(self) -> None:
        """Close every stream open on this engine: each one's reader meets a broken connection (failure.py)."""
        for answer in list(self._streams):
            answer.close()
        self._streams.clear()

    async def probe(self) -> bool:
        """Whether it serves: /health answers, and its supervisor (while its writer lives) neither drains it nor
        brings it up.  The state file is read only after /health answered; its ETA is kept as last read."""
        if not await self.healthy():
            return False
        view = self.records.phase()
        if view is None:
            return True
        self.eta_s = view.eta_s
        return view.phase not in HOLDING_PHASES


@dataclasses.dataclass(frozen=True)
class Failover:
    """New requests went from one engine to another because the first stopped serving."""

    died: str  # the engine that stopped serving
    to: str  # the engine that got the next request
    seconds: float  # from its death (the moment the front saw it stop serving) to that request


class EnginePool:
    """The engines, preferred first; used only from the front's event loop (asyncio: no locks)."""

    def __init__(self, engines: list[Engine], clock: Callable[[], float] = time.monotonic) -> None:
        assert engines, "a front forwards to at least one engine"
        self.engines = engines
        self._any = asyncio.Event()  # set while any engine serves
        self.probe_now = asyncio.Event()  # a request saw an engine break: the watch probes at once
        # Called with the new answer to "does any engine serve" when it changes (watch.py: outages, logs).
        self.on_change: Callable[[bool], None] | None = None
        # Called once per failover, at the first request sent to another engine after one died (watch.py).
        self.on_failover: Callable[[Failover], None] | None = None
        self._clock = clock
        self._death: tuple[Engine, float] | None = None  # the engine whose death waits for its first request elsewhere

    @property
    def main(self) -> Engine:
        return self.engines[0]

    @property
    def serving(self) -> bool:
        """Any engine serves now."""
        return self._any.is_set()

    @property
    def spares(self) -> list[Engine]:
        """The engines after the main one: its hot spare, when the front has one (docs/spare.md)."""
        return self.engines[1:]

    @property
    def serving_engine(self) -> Engine | None:
        """The engine new requests go to now; None while none serves."""
        return next((e for e in self.engines if e.serving), None)

    def pick(self) -> Engine:
        """The first engine that serves; the main one when none does (a probe, or a request the hold let through
        just before the engine stopped, goes to it and meets what it meets).  The first request sent to another
        engine after one died ends that failover (`on_failover`)."""
        engine = self.serving_engine
        if engine is None:
            return self.main
        if self._death is not None and self._death[0] is not engine:
            died, at = self._death
            self._death = None
            if self.on_failover is not None:
                self.on_failover(Failover(died.name, engine.name, self._clock() - at))
        return engine

    @property
    def eta_s(self) -> float | None:
        """The soonest load ETA an engine's supervisor gave."""
        etas = [e.eta_s for e in self.engines if e.eta_s is not None]
        return min(etas) if etas else None

    def mark(self, engine: Engine, serving: bool) -> None:
        before = self.serving_engine
        if not serving:
            engine.facts.clear()
        engine.serving = serving
        if before is engine and not serving and len(self.engines) > 1:
            # The engine new requests went to died: its failover runs until a request goes to another.
            self._death = (engine, self._clock())
        elif serving and self._death is not None and self._death[0] is engine and self.serving_engine is engine:
            self._death = None  # back before any request went elsewhere: no failover happened
        now = any(e.serving for e in self.engines)
        if now == self.serving:
            return
        if now:
            self._any.set()
        else:
            self._any.clear()
        if self.on_change is not None:
            self.on_change(now)

    def broke(self, engine: Engine) -> None:
        """A request met this engine broken: no new request goes to it, and the watch probes it at once rather
        than at its next tick."""
        self.mark(engine, False)
        self.probe_now.set()

    async def until_serving(self, timeout_s: float) -> bool:
        """True once any engine serves (at once if one does), False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._any.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
