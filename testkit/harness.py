"""Run the real `kimi-supervisor` CLI around the fake vLLM, with a notify socket.

Shared by the lifecycle tests, the fault matrix and the benchmarks.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from testkit.fakes.notify_socket import NotifySocket
from testkit.procutil import free_port as free_port  # re-exported: tests and benches import it from here

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "testkit" / "fakes" / "fake_vllm.py"

# The Runs started since the current test began, while tests/run_errors.py records them (None: not recording,
# e.g. in a benchmark): a failing test's report then shows the traceback of each error-level record its
# supervisors wrote (an `operator_view.error` the product swallowed), not only the event's name.
STARTED: list[Run] | None = None


def error_records(runs: list[Run]) -> str:
    """Each error-level record of these runs, its traceback in full; "" when there is none."""
    out = []
    for run in runs:
        for e in list(run.events):
            if not (str(e.get("event", "")).endswith(".error") or e.get("level") == "error"):
                continue
            rest = {k: v for k, v in e.items() if k != "traceback"}
            out.append(f"supervisor PID {run.proc.pid}: {json.dumps(rest, default=str)}")
            if e.get("traceback"):
                out.append(str(e["traceback"]).rstrip("\n"))
    return "\n".join(out)


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def own_dirs(base: Path) -> dict[str, str]:
    """`[paths]` under `base`: the instance locks, the state file and the history, never the host's own."""
    return {
        "runtime_directory": str(base / "run"),
        "state_directory": str(base / "state"),
        "cache_directory": str(base / "cache"),
    }


def short_link(target: Path) -> Path:
    """A short path (/tmp/kw-XXXXXXXX/d) that is a link to `target`, removed when this test process exits."""
    made = Path(tempfile.mkdtemp(prefix="kw-", dir="/tmp"))
    # mkdtemp's 0700 would stop a child user (holder_user) on its way through the link.
    made.chmod(0o755)
    atexit.register(shutil.rmtree, made, True)
    target.mkdir(parents=True, exist_ok=True)
    (made / "d").symlink_to(target)
    return made / "d"


def write_config(path: Path, sections: dict[str, dict[str, Any]], host_paths: bool = False) -> Path:
    """Write SECTIONS as TOML.  Without a `paths` table the config gets directories of its own next to the file
    (a supervisor a test starts must never take the host's port lock or write its state and history);
    `host_paths=True` keeps the defaults, for a config that runs inside a container, where they are its own."""
    if "paths" not in sections and not host_paths:
        sections = {**sections, "paths": own_dirs(path.parent)}
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def fake_sections(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """What every fake-vLLM config shares: no GPUs, its own shm directory and paths, fast timings."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return {
        "preflight": {"gpus": [], "check_model": False},
        "preflight.shm": {"directory": str(shm)},
        # Bounds of a hang, not of this machine's speed: beside a second suite a fake that loads in 0.5 s was
        # silent for 20 s (a test that means a stall or a deadline sets its own).
        "readiness": {"stall_timeout_s": 120, "deadline_s": 300, "poll_interval_s": 0.1},
        "health": {"interval_s": 0.3, "timeout_s": 1, "failures_tolerated": 3},
        "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
        "paths": own_dirs(tmp_path),
    }


def fake_config(tmp_path: Path, fake_args: list[str] | None = None, tp: int = 2, **sections: dict[str, Any]) -> Path:
    port = free_port()
    argv = [
        sys.executable,
        str(FAKE),
        "serve",
        str(tmp_path / "model"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--load-seconds",
        "0.5",
        "--shards",
        "4",
        "--max-lifetime",
        "120",
        *(fake_args or []),
    ]
    cfg: dict[str, dict[str, Any]] = {
        "child": {"argv": argv, "env": {"KIMI_TEST_MARKER": str(tmp_path)}},
        **fake_sections(tmp_path),
    }
    for key, value in sections.items():
        cfg.setdefault(key.replace("__", "."), {}).update(value)
    return write_config(tmp_path / "kimi.toml", cfg)


# How long a test waits for a supervisor's event or exit unless it says: only a hang's bound (a start that took
# 30 s beside a second suite is slow, not wrong), never a verdict on this machine's speed.
HANG_S = 180.0

PRIVATE_SHM = 'mount -t tmpfs -o mode=1777 kimi-test-shm /dev/shm && exec "$@"'


class Run:
    """A running supervisor: its JSON events, child lines and notify datagrams."""

    def __init__(
        self,
        config: Path,
        tmp_path: Path,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        read_stdout: bool = True,
        entry: list[str] | None = None,
        private_shm: bool = False,
        netns: str | None = None,
        notify_mode: int | None = None,
    ) -> None:
        self.notify = NotifySocket(tmp_path, mode=notify_mode)
        full_env = {**os.environ, "NOTIFY_SOCKET": self.notify.path, "PYTHONPATH": str(REPO), **(env or {})}
        command = [*(entry or ["-m", "kimi_supervisor"]), "--config", str(config), "--log-format", "json"]
        # private_shm: the supervisor and its tree in a mount namespace of their own with a fresh tmpfs on
        # /dev/shm (root only), for a real vLLM, which leaves psm_*/sem.mp-* files there when it is killed: they
        # vanish with the namespace, and nothing of the host's /dev/shm is ever read, removed or left behind.
        # `exec`: run.proc.pid is the supervisor itself.
        wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh"]
        # netns: inside a network namespace the test created (`ip netns exec` execs, so the pid stays ours).
        inside = ["ip", "netns", "exec", netns] if netns else []
        self.proc = subprocess.Popen(
            [*inside, *(wrapper if private_shm else []), sys.executable, *command, *(args or [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=REPO,
        )
        self.events: list[dict[str, Any]] = []
        self.child_lines: list[dict[str, Any]] = []
        if STARTED is not None:
            STARTED.append(self)
        self.raw_stderr: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stderr, True), daemon=True)]
        self._threads[0].start()
        if read_stdout:  # else stdout is a pipe nobody reads (a stalled reader) until read_stdout()
            self.read_stdout()

    def read_stdout(self) -> None:
        t = threading.Thread(target=self._read, args=(self.proc.stdout, False), daemon=True)
        self._threads.append(t)
        t.start()

    def _read(self, stream: Any, events: bool) -> None:
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                record = json.loads(line)
            except ValueError:
                self.raw_stderr.append(line)
                continue
            (self.events if events else self.child_lines).append(record)

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def wait_event(self, name: str, timeout: float = HANG_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.event(name)
            if found:
                return found
            if self.proc.poll() is not None:
                # It has exited: its stderr ends at EOF, so the reader has everything once it has read to the end.
                self._threads[0].join(timeout=10)
                found = self.event(name)
                if found:
                    return found
                raise AssertionError(
                    f"supervisor exited {self.proc.returncode} before {name}: {self.names()}"
                    f" {self.why()} {self.raw_stderr[-5:]}"
                )
            time.sleep(0.02)
        raise AssertionError(f"no {name} within {timeout}s: {self.names()}")

    def why(self) -> str:
        """What the supervisor said of its end: the failed checks and the exit record (a failing test's message
        then names the cause, e.g. a port another process held, not only the exit code)."""
        said = [e for e in list(self.events) if e.get("event") in ("state.failed", "supervisor.exit")]
        said += [e for e in list(self.events) if e.get("status") == "fail" or e.get("level") == "error"][:5]
        return json.dumps(said, default=str)[:2000]

    def names(self) -> list[str]:
        return [e.get("event", "?") for e in list(self.events)]

    @property
    def child_pid(self) -> int:
        started = self.wait_event("state.starting")
        return int(started["pid"])

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> float:
        t = time.monotonic()
        self.proc.send_signal(sig)
        return t

    def wait(self, timeout: float = HANG_S) -> int:
        rc = self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout=5)
        self.notify.close()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


def session_members(sid: int) -> list[psutil.Process]:
    """Live processes in session `sid` (the child's tree, unless members called setsid)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.NoSuchProcess):
            continue
    return out


def processes_matching(predicate: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and predicate(p):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def fake_tree_of(marker: str) -> list[psutil.Process]:
    """Every live process started with KIMI_TEST_MARKER=`marker` in its environment.

    The environment survives setproctitle-style argv rewriting, setsid and
    reparenting, so it finds a child tree however its members behaved.
    """

    def ours(p: psutil.Process) -> bool:
        try:
            return p.environ().get("KIMI_TEST_MARKER") == marker
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            return False

    return processes_matching(ours)


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded loopback HTTP server for `handler` while the block runs; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


READY_CHILD = REPO / "testkit" / "ready_child.py"


@dataclasses.dataclass(frozen=True)
class ReadyTimes:
    """When READY=1 reached the notify socket, the child started listening, and it sent its first 200."""

    ready: float
    listening: float
    first_200: float


def ready_child_times(tmp: Path, poll_s: float, listen_after: float) -> ReadyTimes:
    """One real supervisor run around testkit/ready_child.py, listening `listen_after` s after its start line."""
    argv = [
        sys.executable,
        str(READY_CHILD),
        "--port",
        str(free_port()),
        "--listen-after",
        f"{listen_after:.3f}",
        "--listening-marker",
        str(tmp / "listening"),
        str(tmp / "first-200"),
    ]
    shm = tmp / "shm"
    shm.mkdir()
    cfg = write_config(
        tmp / "kimi.toml",
        {
            "child": {"argv": argv},
            "preflight": {"gpus": [], "check_model": False},
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"poll_interval_s": poll_s, "deadline_s": 30},
            "shutdown": {"grace_s": 3, "gpu_release_timeout_s": 0},
            "paths": own_dirs(tmp),
        },
    )
    run = Run(cfg, tmp)
    try:
        run.wait_event("state.ready", timeout=30)
        deadline = time.monotonic() + 5
        while (ready := run.notify.first("READY", "1")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready is not None, "state.ready logged but no READY=1 datagram"
        run.signal()
        rc = run.wait(timeout=15)
        assert rc == 0, f"supervisor exited {rc}"
        return ReadyTimes(ready[0], float((tmp / "listening").read_text()), float((tmp / "first-200").read_text()))
    finally:
        run.kill()


def weights_pair(
    tmp_path: Path,
    holder_args: list[str] | None = None,
    engine_args: list[str] | None = None,
    tp: int = 2,
    wait_s: float = 30,
    holder_user: str | None = None,
    python: str = sys.executable,
) -> tuple[Path, Path]:
    """Configs of one deployment ("kimi") with a weight holder (docs/weight-holder.md): the fake `vllm preload` under
    role "weights" (kimi.weights.toml) and the fake engine mapping it (kimi.toml, `[weights] holder = true`)."""
    holder_argv = [python, str(FAKE), "preload", "--model", str(tmp_path / "model"), "-tp", str(tp)]
    holder_argv += ["--load-seconds", "0.3", "--max-lifetime", "120", *(holder_args or [])]
    # vLLM's socket paths must fit a Unix socket (config/weights.py check_socket_path): pytest's tmp_path is too
    # long for them, so the pair names its runtime directory (still tmp_path/run) by a short link.
    run = short_link(Path(own_dirs(tmp_path)["runtime_directory"]))
    common = {**fake_sections(tmp_path), "paths": {**own_dirs(tmp_path), "runtime_directory": str(run)}}
    holder = write_config(
        tmp_path / "kimi.weights.toml",
        {
            "child": {
                "argv": holder_argv,
                "env": {"KIMI_TEST_MARKER": f"{tmp_path}/holder"},
                **({"user": holder_user} if holder_user else {}),
            },
            "deployment": {"name": "kimi", "role": "weights"},
            "weights": {"health_port": free_port()},
            **common,
        },
    )
    sockets = Path(common["paths"]["runtime_directory"]) / "kimi" / "weight-cache"
    extra = json.dumps({"socket_dir": str(sockets), "mode": "zero_copy", "fallback": False})
    engine_argv = [sys.executable, str(FAKE), "serve", str(tmp_path / "model"), "--host", "127.0.0.1"]
    engine_argv += ["--port", str(free_port()), "--tensor-parallel-size", str(tp), "--load-seconds", "0.3"]
    engine_argv += ["--shards", "2", "--max-lifetime", "120", "--load-format", "ipc_cache"]
    engine_argv += ["--model-loader-extra-config", extra, *(engine_args or [])]
    engine = write_config(
        tmp_path / "kimi.toml",
        {
            "child": {"argv": engine_argv, "env": {"KIMI_TEST_MARKER": f"{tmp_path}/engine"}},
            "deployment": {"name": "kimi"},
            "weights": {"holder": True, "wait_s": wait_s},
            **common,
            "preflight": {"gpus": [], "check_model": False, "poll_interval_s": 0.1},
        },
    )
    return holder, engine
