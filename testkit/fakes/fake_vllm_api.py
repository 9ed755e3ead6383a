"""The fake vLLM's main process (vLLM's APIServer): start the engine, serve HTTP, die or stop like vLLM.

Modes that act after ready are rows of `after_ready()`: (seconds after ready, what happens). Adding one
is a flag in fake_vllm_options.py, a row there, and, when it changes an HTTP answer, a flag on
fake_vllm_http.APP that the route reads.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from testkit.fakes import fake_vllm_tree as tree
from testkit.fakes.fake_vllm_http import APP, Handler, Server
from testkit.fakes.fake_vllm_options import Config
from testkit.fakes.fake_vllm_output import excerpt, flood, identify, invalid_utf8, long_line, plain, replay
from testkit.fakes.fake_vllm_proc import P, Stop, check, install_term, pause, reap, set_comm, stop_children

SHUTDOWN_DONE = "Application shutdown complete."


class Main:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sock: socket.socket | None = None
        self.server: Server | None = None
        self.engine = 0
        self.engine_reaped = False
        self.ready_r = -1

    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    def run(self) -> NoReturn:
        cfg = self.cfg
        P.label, P.pid, P.quiet = "APIServer", os.getpid(), cfg.silent_load
        if cfg.max_lifetime > 0:
            P.deadline = time.monotonic() + cfg.max_lifetime
        install_term(cfg.ignore_sigterm or cfg.ignore_sigterm_during_load)
        if cfg.flood_only:
            flood(cfg.flood_lines, cfg.flood_line_bytes)
            os._exit(0)
        set_comm("vllm")  # the `vllm` console script
        identify(cfg.model, self.url(), cfg.port)
        for name in cfg.print_env:
            value = os.environ.get(name)
            plain(
                f"fake-vllm env {name}={value}" if value is not None else f"fake-vllm env {name} unset", important=True
            )
        try:
            replay(excerpt(tree.STARTUP, "Triton is installed", "Enabled custom fusions"))
            self.stress_output()
            self.bind()
            if cfg.flood_lines:
                flood(cfg.flood_lines, cfg.flood_line_bytes)
            self.start_engine()
            self.wait_engine_ready()
        except Stop as stop:
            self.stop_during_load(stop)
        self.ready()
        self.serve()

    # ---------------------------------------------------------------------------------------- loading

    def stress_output(self) -> None:
        if self.cfg.long_line:
            long_line(self.cfg.long_line, newline=not self.cfg.long_line_no_newline)
        if self.cfg.invalid_utf8:
            invalid_utf8()

    def bind(self) -> None:
        """Bind now (as vLLM's setup_server does), listen only once ready."""
        cfg = self.cfg
        if cfg.uds is not None:  # vLLM binds the path as it is (create_server_unix_socket): no unlink first
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(cfg.uds if cfg.uds is not None else (cfg.host, cfg.port))
        except OSError as exc:
            sock.close()
            plain(f"OSError: [Errno {exc.errno}] {exc.strerror}", important=True)
            os._exit(1)
        self.sock = sock

    def start_engine(self) -> None:
        pause(0.05 * self.cfg.load_seconds)
        r, w = os.pipe()
        # The engine does not keep the listening socket: the port is free once the APIServer is gone.
        pid = tree.fork(self.cfg, "EngineCore", [r, *([self.sock.fileno()] if self.sock else [])])
        if pid == 0:
            tree.engine_main(self.cfg, w)
        os.close(w)
        self.engine = pid
        self.ready_r = r

    def wait_engine_ready(self) -> None:
        while True:
            check()
            try:
                readable, _, _ = select.select([self.ready_r], [], [], 0.05)
            except InterruptedError:
                continue
            if not readable:
                continue
            if os.read(self.ready_r, 64) == b"R":
                os.close(self.ready_r)
                return
            pause(0.05)  # a group-wide SIGTERM is not an engine failure
            reap([self.engine], 3.0)
            self.engine_reaped = True
            last = "Engine core initialization failed"
            replay(excerpt(tree.FAILED, "Traceback (most recent call last):", last, nth=-1), important=True)
            os._exit(1)

    def stop_during_load(self, stop: Stop) -> NoReturn:
        if stop.reason == "lifetime":
            tree.lifetime_exit([] if self.cfg.orphan_workers else [self.engine])
        self.stop_engine(graceful=True)
        # The real frames down to the startup wait, then what vLLM's SIGTERM handler raises there.
        frames = excerpt(tree.FAILED, "Traceback (most recent call last):", "wait_for_engine_startup(", nth=-1)
        replay([*frames, "KeyboardInterrupt: terminated"], important=True)
        # Python ends an uncaught KeyboardInterrupt by re-raising SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        os._exit(130)

    # ---------------------------------------------------------------------------------------- serving

    def ready(self) -> None:
        P.quiet = False
        APP.cfg = self.cfg
        assert self.sock is not None
        where = ("127.0.0.1", 0) if self.cfg.uds is not None else self.sock.getsockname()[:2]
        srv = Server(where, Handler, bind_and_activate=False)  # its own socket replaced by ours below
        srv.socket.close()
        srv.socket = self.sock
        replay(excerpt(tree.STARTUP, "Supported tasks", "Application startup complete."))
        srv.server_activate()  # listen(): connections are accepted from here on
        self.server = srv
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, name="uvicorn", daemon=True).start()
        install_term(self.cfg.ignore_sigterm)

    def after_ready(self) -> list[tuple[float, Callable[[], None]]]:
        cfg = self.cfg
        rows: list[tuple[float | None, Callable[[], None]]] = [
            (cfg.hang_after_ready, self.hang),
            (cfg.unhealthy_after, self.unhealthy),
            (cfg.trickle_health_after, self.trickle),
            (cfg.wedged_after, self.wedge),
            (cfg.exit_after_ready, lambda: self.uvicorn_exit(cfg.exit_code)),
        ]
        return [(at, act) for at, act in rows if at is not None]

    def hang(self) -> None:
        APP.hung = True
        P.quiet = True

    def unhealthy(self) -> None:
        APP.unhealthy = True

    def trickle(self) -> None:
        APP.trickle = True

    def wedge(self) -> None:
        with APP.lock:
            APP.wedged, APP.running = True, APP.running + 2  # two requests were in the engine when it stuck

    def serve(self) -> NoReturn:
        t_ready = time.monotonic()
        pending = self.after_ready()
        while True:
            try:
                pause(0.05, step=0.05)
            except Stop as stop:
                if stop.reason == "lifetime":
                    tree.lifetime_exit([] if self.cfg.orphan_workers else [self.engine])
                self.sigterm_shutdown()
            if self.engine_exited():
                self.engine_death()
            since = time.monotonic() - t_ready
            for row in [r for r in pending if since >= r[0]]:
                pending.remove(row)
                row[1]()
            if self.cfg.hang_when is not None and not APP.hung and os.path.exists(self.cfg.hang_when):
                self.hang()

    # ----------------------------------------------------------------------------------------- ending

    def stop_engine(self, graceful: bool) -> None:
        if self.engine and not self.engine_reaped and not self.cfg.orphan_workers:
            stop_children([self.engine], graceful)
            self.engine_reaped = True

    def engine_exited(self) -> bool:
        if not self.engine or self.engine_reaped:
            return False
        try:
            done, _ = os.waitpid(self.engine, os.WNOHANG)
        except ChildProcessError:
            done = self.engine
        self.engine_reaped = bool(done)
        return self.engine_reaped

    def close_http(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def sigterm_shutdown(self) -> NoReturn:
        labels = ("APIServer",)
        replay(excerpt(tree.SHUTDOWN, "shutdown triggered", "send sigterm to process EngineCore", labels=labels))
        self.stop_engine(graceful=True)
        replay(excerpt(tree.SHUTDOWN, "engine manager stopped", "shutting down FastAPI HTTP server", labels=labels))
        self.close_http()
        replay(excerpt(tree.SHUTDOWN, "INFO:     Shutting down", SHUTDOWN_DONE))
        os._exit(0)

    def uvicorn_exit(self, code: int) -> NoReturn:
        """uvicorn's own should_exit path (engine death, --exit-after-ready)."""
        self.close_http()
        replay(excerpt(tree.WORKER_KILLED, "INFO:     Shutting down", "MPClient: complete", labels=("APIServer",)))
        self.stop_engine(graceful=True)
        os._exit(code)

    def engine_death(self) -> NoReturn:
        with contextlib.suppress(Stop):
            pause(0.05)
        if P.stop_requested:
            self.sigterm_shutdown()
        APP.engine_dead = True
        dead = "EngineDeadError"
        replay(
            excerpt(tree.WORKER_KILLED, "AsyncLLM output_handler failed.", dead, labels=("APIServer",)), important=True
        )
        try:
            pause(self.cfg.engine_death_exit_delay)
        except Stop:
            self.sigterm_shutdown()
        self.uvicorn_exit(0)
