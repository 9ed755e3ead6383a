"""vLLM's --uds socket before the spawn (kimi_supervisor/child/engine_socket.py, docs/front.md): vLLM 0.32 binds
without removing a dead socket, so the supervisor removes one nobody listens on, and only that."""

from __future__ import annotations

import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.child.engine_socket import remove_dead_socket
from kimi_supervisor.config.load import load_config
from kimi_supervisor.deployment.choose import for_config
from kimi_supervisor.exitcodes import AnotherInstance, ConfigError
from testkit.fakes.log import RecordingLog
from testkit.harness import write_config


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A Unix socket's path has at most 107 bytes: pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="ksock-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _dead_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # a killed server's socket: the file stays, nobody listens


def test_a_dead_socket_is_removed_and_nothing_is_no_change(short_dir: Path) -> None:
    path = short_dir / "engine.sock"
    assert remove_dead_socket(path) is False
    _dead_socket(path)
    assert remove_dead_socket(path) is True
    assert not path.exists()


def test_a_live_listener_is_another_server_and_stays(short_dir: Path) -> None:
    path = short_dir / "engine.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    try:
        with pytest.raises(AnotherInstance, match="another server listens on it"):
            remove_dead_socket(path)
        assert stat.S_ISSOCK(path.lstat().st_mode)
    finally:
        live.close()


def test_what_is_not_a_socket_is_refused_not_removed(short_dir: Path) -> None:
    path = short_dir / "engine.sock"
    path.write_text("the operator's file")
    with pytest.raises(ConfigError, match="not a socket"):
        remove_dead_socket(path)
    assert path.read_text() == "the operator's file"


def test_the_engine_makes_the_fronts_socket_directory_and_removes_a_dead_socket(short_dir: Path) -> None:
    runtime = short_dir / "run"
    uds = runtime / "kimi-a" / "front" / "engine.sock"
    config = write_config(
        short_dir / "kimi-a.toml",
        {
            "child": {"argv": ["vllm", "serve", "/m", "--uds", str(uds)]},
            "paths": {"runtime_directory": str(runtime), "state_directory": str(short_dir / "state")},
        },
    )
    cfg = load_config(config)
    (runtime / "kimi-a").mkdir(parents=True)  # the supervisor's own, made before the run (files/dirtrust.py)
    log = RecordingLog()
    role = for_config(cfg)
    role.prepare_child(cfg, None, log)
    assert stat.S_IMODE(uds.parent.stat().st_mode) == 0o700
    assert log.events("engine_socket.removed") == []
    _dead_socket(uds)  # what a SIGKILLed vLLM leaves: its restart would fail with "Address already in use"
    role.prepare_child(cfg, None, log)
    assert not uds.exists()
    assert log.events("engine_socket.removed") == [
        {"path": str(uds), "why": "a killed vLLM's socket: vLLM would not bind over it"}
    ]


def test_an_engine_on_its_socket_locks_no_tcp_port_so_its_front_can(short_dir: Path) -> None:
    """Both lock host-wide resources (host/instance_lock.py): the engine on --uds takes no port lock, so the
    front holding the public port (port-8000.lock) does not refuse it with exit 16."""

    base = {"paths": {"runtime_directory": str(short_dir / "run"), "state_directory": str(short_dir / "state")}}
    tcp = load_config(write_config(short_dir / "a.toml", {"child": {"argv": ["vllm", "serve", "/m"]}, **base}))
    uds = ["vllm", "serve", "/m", "--uds", str(short_dir / "e.sock")]
    on_socket = load_config(write_config(short_dir / "b.toml", {"child": {"argv": uds}, **base}))
    assert for_config(tcp).serving_port == 8000
    assert for_config(on_socket).serving_port is None
    names = [r.filename for r in for_config(on_socket).lock_resources(()).locks()]
    assert "deployment-b.lock" in names and "port-8000.lock" not in names  # its child's NCCL RAS port is locked too
