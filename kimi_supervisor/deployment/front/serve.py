"""The front's run (docs/front.md): its one asyncio loop until SIGTERM or SIGINT.

READY=1 once it listens, whatever the engine is doing (systemd's view of the front is the front); the headline
says whether the engine serves and how many requests wait; WATCHDOG=1 at half of WatchdogSec from the loop
itself, so a wedged loop is restarted; STOPPING=1, then the open connections are closed within
`SHUTDOWN_S` (a stream still open then is cut: the front's own restart is not covered, the engine's is).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.proxy import Front
from kimi_supervisor.exitcodes import ExitCode, PreflightError
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd.notify import Notifier

SHUTDOWN_S = 10.0
TICK_S = 1.0  # the headline's refresh; the watchdog's ping comes at least every half period


async def serve(cfg: FrontConfig, log: Logger, notifier: Notifier, watchdog_s: float | None) -> None:
    front = Front(cfg, log)
    runner = front.runner(shutdown_timeout=SHUTDOWN_S)
    stopped = False
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, cfg.host, cfg.port).start()
        except OSError as exc:
            raise PreflightError(f"front.port: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("front.listening", host=cfg.host, port=cfg.port, engine_socket=str(cfg.engine_socket))
        said = front.headline()
        notifier.send(READY=1, STATUS=said)
        period = min(TICK_S, watchdog_s / 2) if watchdog_s else TICK_S
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
            if watchdog_s:
                notifier.send(WATCHDOG=1)
            now = front.headline()
            if now != said:
                notifier.send(STATUS=now)
                said = now
        notifier.send(STOPPING=1, STATUS="stopping")
        log.info("front.stopping", held=front.gate.held)
        stopped = True
    finally:
        await runner.cleanup()  # stops listening, then closes the open connections within SHUTDOWN_S
    if stopped:
        front.write_state("stopped", exit_code=0)


def run(cfg: FrontConfig, log: Logger, notifier: Notifier, watchdog_s: float | None) -> ExitCode:
    asyncio.run(serve(cfg, log, notifier, watchdog_s))
    return ExitCode.OK
