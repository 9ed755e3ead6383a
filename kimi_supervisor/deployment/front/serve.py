"""The front's run (docs/front.md): its one asyncio loop until SIGTERM or SIGINT.

READY=1 once it listens, whatever the engine is doing (systemd's view of the front is the front); the headline
says whether the engine serves and how many requests wait; WATCHDOG=1 at half of WatchdogSec from the loop
itself, so a wedged loop is restarted; STOPPING=1, then the open connections are closed within
`SHUTDOWN_S` (a stream still open then is cut: the front's own restart is not covered, the engine's is).

Root's work comes first and the loop starts only after the drop (docs/front.md, "Who it runs as"): the instance
locks (cli/entry.py, held by their descriptors), the public port bound here (a port < 1024 needs root), the
engine's socket directory and the front's state directory made for its account; then setgroups/setgid/setuid
(child/spawnplan.py become, the same identity the engine's child gets), then asyncio serves what was bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket

from aiohttp import web

from kimi_supervisor.child.spawnplan import Identity, become, switch_to
from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.proxy import FrontServer
from kimi_supervisor.exitcodes import ConfigError, ExitCode, NoPermission, PreflightError
from kimi_supervisor.files import privdir
from kimi_supervisor.files.atomic import ensure_directory
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.preflight.checks import listener
from kimi_supervisor.systemd.notify import Notifier

SHUTDOWN_S = 10.0
TICK_S = 1.0  # the headline's refresh; the watchdog's ping comes at least every half period


def listen(cfg: FrontConfig) -> socket.socket:
    """The public port, bound and listening before the drop (a port < 1024 is root's)."""
    try:
        family = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((cfg.host, cfg.port), family=family, backlog=1024)
    except OSError as exc:
        who = listener(cfg.port)[1] if exc.errno == errno.EADDRINUSE else ""  # as the dry run's port row names it
        # create_server's own strerror repeats the address ("(while attempting to bind on address ...)").
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise PreflightError(f"front.port: cannot listen on {cfg.host}:{cfg.port}: {why}{who}") from None


def prepare_for(cfg: FrontConfig, identity: Identity) -> None:
    """The directories the front uses after the drop, made by root for its account: the engine's socket
    directory (0700, the same the engine's supervisor makes for its child, child/engine_socket.py) and the
    front's state directory (0755: a non-root `status` reads the file)."""
    targets = [(cfg.engine_socket.parent, 0o700)]
    if cfg.state_file is not None:
        targets.append((cfg.state_file.parent, 0o755))
    for directory, mode in targets:
        try:
            ensure_directory(directory.parent)
            privdir.private_dir(directory.parent, directory.name, identity.uid, identity.gid, mode=mode)
        except privdir.Refused as exc:
            raise ConfigError(f"front.user {identity.user!r}: {exc.message}") from None
        except OSError as exc:
            raise NoPermission(f"cannot make {directory} for user {identity.user!r}: {exc.strerror}") from None


async def serve(
    cfg: FrontConfig, log: Logger, notifier: Notifier, watchdog_s: float | None, listening: socket.socket
) -> None:
    front = FrontServer(cfg, log)
    runner = front.runner(shutdown_timeout=SHUTDOWN_S)
    stopped = False
    await runner.setup()
    try:
        await web.SockSite(runner, listening).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("front.listening", host=cfg.host, port=cfg.port, engine_socket=str(cfg.engine_socket))
        said = front.watch.headline()
        notifier.send(READY=1, STATUS=said)
        period = min(TICK_S, watchdog_s / 2) if watchdog_s else TICK_S
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
            if watchdog_s:
                notifier.send(WATCHDOG=1)
            now = front.watch.headline()
            if now != said:
                notifier.send(STATUS=now)
                said = now
        notifier.send(STOPPING=1, STATUS="stopping")
        log.info("front.stopping", held=front.gate.held)
        stopped = True
    finally:
        await runner.cleanup()  # stops listening, then closes the open connections within SHUTDOWN_S
    if stopped:
        front.watch.write_state("stopped", exit_code=0)


def run(
    cfg: FrontConfig, log: Logger, notifier: Notifier, watchdog_s: float | None, identity: Identity | None
) -> ExitCode:
    """`identity`: the account to serve as (None: stay as started)."""
    listening = listen(cfg)
    drop = switch_to(identity)
    if drop is not None:
        prepare_for(cfg, drop)
        try:
            become(drop)
        except OSError as exc:
            raise NoPermission(f"front.user {drop.user!r}: cannot drop to it: {exc}") from None
        log.info("front.dropped", user=drop.user, uid=drop.uid, gid=drop.gid)
    asyncio.run(serve(cfg, log, notifier, watchdog_s, listening))
    return ExitCode.OK
