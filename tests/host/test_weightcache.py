"""The daemons' own answer to vLLM's get_memory, asked as their user (docs/weight-holder.md)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.host.weightcache import allocated
from tests.conftest import ProcSpawner, interpreter

NOBODY = 65534

# vLLM's daemon side (daemon.py:345-426): a 0600 socket in its own directory, the peer's uid checked by
# SO_PEERCRED (protocol.py:212-228), `{"status": "ok", "memory_bytes": N}` for get_memory.
DAEMON = """
import os, pickle, socket, struct, sys
LEN = struct.Struct("!Q")
path, nbytes = sys.argv[1], int(sys.argv[2])
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o600)
server.listen()
print("up", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        (n,) = LEN.unpack(conn.recv(8, socket.MSG_WAITALL))
        request = pickle.loads(conn.recv(n, socket.MSG_WAITALL))
        if uid != os.getuid():
            reply = {"status": "error", "message": f"Rejecting weight cache connection from uid {uid}"}
        else:
            reply = {"status": "ok", "memory_bytes": nbytes} if request.get("cmd") == "get_memory" else {}
        body = pickle.dumps(reply)
        conn.sendall(LEN.pack(len(body)) + body)
"""


@pytest.fixture
def nobodys_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kw-"))
    path.chmod(0o755)
    sockets = path / "weight-cache"
    sockets.mkdir(mode=0o700)
    os.chown(sockets, NOBODY, NOBODY)
    try:
        yield sockets
    finally:
        shutil.rmtree(path)


def test_asks_each_daemon_as_its_own_user_and_matches_it_by_pid(nobodys_dir: Path, spawner: ProcSpawner) -> None:
    daemons = {}
    for i, nbytes in enumerate((7 << 30, 3 << 30)):
        sock = nobodys_dir / f"vllm_weight_cache_{i:032x}{'_draft' if i else ''}.sock"
        p = spawner.start([interpreter(NOBODY), "-c", DAEMON, str(sock), str(nbytes)], uid=NOBODY)
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        daemons[p.pid] = nbytes
    (nobodys_dir / "vllm_weight_cache_stale.sock").touch()  # not a socket: not asked
    held, unanswered = allocated(nobodys_dir)
    assert (held, unanswered) == (daemons, [])


def test_a_daemon_that_does_not_answer_is_named_and_credited_nothing(nobodys_dir: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(nobodys_dir / "vllm_weight_cache_dead.sock"))  # bound, never listening: refused
        held, unanswered = allocated(nobodys_dir)
    assert held == {} and len(unanswered) == 1
    assert unanswered[0].startswith("vllm_weight_cache_dead.sock: ConnectionRefusedError"), unanswered
