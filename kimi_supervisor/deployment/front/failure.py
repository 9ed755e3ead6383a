"""The one place that decides "the engine failed under this request" (docs/front.md, Retry and Resume).

Three signs, one verdict (EngineBroke, the engine marked not serving and probed at once):
- the connection broke: refused or missing socket, a reset, a body cut short (engine.py BROKEN), or a stream
  that ended before its [DONE];
- a 5xx answer while the engine's /health fails: the engine is going, not the request at fault (a 5xx while
  /health answers is the request's own answer, passed on);
- vLLM's error chunk inside a stream while /health fails (EngineDeadError: it writes one, then exits).
A retry (forward.py) or a resume (streams.py) follows the verdict; every other failure is the request's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kimi_supervisor.deployment.front.context import JSON_DEPTH
from kimi_supervisor.deployment.front.engine import BROKEN, Engine, EnginePool
from kimi_supervisor.untrusted_json import parse_json


class EngineBroke(Exception):
    """The engine went away under a request; `why` names what was seen (its logs' `why`)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class AnswerCut(Exception):
    """The engine went away under an answer the front passed on as it came (not held, so not sent again): the
    client's connection is closed, not answered again."""


class Failures:
    def __init__(self, engines: EnginePool) -> None:
        self.engines = engines

    @contextlib.asynccontextmanager
    async def connection(self, engine: Engine, marks: bool = True) -> AsyncIterator[None]:
        """A broken connection inside the block is EngineBroke.  `marks=False` for a monitor's probe of the
        engine's own /health or /metrics: its failure is answered, the engine's state is the watch's to say."""
        try:
            yield
        except BROKEN as exc:
            if marks:
                self.engines.broke(engine)
            raise EngineBroke(type(exc).__name__) from exc

    def cut_short(self, engine: Engine) -> EngineBroke:
        """What to raise for a stream that ended before its [DONE]: the engine closed it under the request."""
        self.engines.broke(engine)
        return EngineBroke(EngineBroke.__name__)

    async def answer(self, engine: Engine, status: int) -> None:
        """EngineBroke for a 5xx while the engine's /health fails; nothing for any other answer."""
        if status >= 500 and await self._down(engine):
            raise EngineBroke(EngineBroke.__name__)

    async def chunk(self, engine: Engine, data: bytes) -> object:
        """One event's JSON; EngineBroke for vLLM's error chunk of a dying engine (/health fails then): the stream
        is resumed rather than ended."""
        chunk = parse_json(data, JSON_DEPTH)
        if isinstance(chunk, dict) and "error" in chunk and await self._down(engine):
            raise EngineBroke(EngineBroke.__name__)
        return chunk

    async def _down(self, engine: Engine) -> bool:
        if await engine.healthy():
            return False
        self.engines.broke(engine)
        return True
