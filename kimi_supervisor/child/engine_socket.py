"""vLLM's `--uds PATH` before the spawn: an engine behind its front (docs/front.md) serves on a Unix socket.

vLLM 0.32 binds the path without removing what is there (entrypoints/launchers/launcher.py,
create_server_unix_socket: `sock.bind(path)`), so the socket a killed vLLM left makes every restart fail with
"Address already in use" after its whole start.  The supervisor removes it first, but only a socket nobody
listens on: a live listener is another server (exit 16, nothing removed), anything else at the path is refused
(exit 78).  The front's standard directory, `<runtime>/NAME/front`, is made 0700 for the child's account
(files/privdir.py), so the front, which runs as that account, is the only other process that reaches it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from kimi_supervisor.child.spawnplan import Identity, uid_gid
from kimi_supervisor.config.front import SOCKET_DIR
from kimi_supervisor.exitcodes import AnotherInstance, ConfigError, NoPermission
from kimi_supervisor.files import privdir
from kimi_supervisor.logs.types import Logger

CONNECT_TIMEOUT_S = 1.0


def prepare_engine_socket(uds: Path, deployment_runtime: Path, identity: Identity | None, log: Logger) -> None:
    """Make the front's socket directory when `uds` is in it, and remove a dead socket at `uds`."""
    if uds.parent == deployment_runtime / SOCKET_DIR:
        uid, gid = uid_gid(identity)
        try:
            privdir.private_dir(deployment_runtime, SOCKET_DIR, uid, gid)
        except privdir.Refused as exc:
            raise ConfigError(f"child.argv --uds: socket directory {exc.message}") from None
        except OSError as exc:
            raise NoPermission(f"cannot make the engine's socket directory {uds.parent}: {exc.strerror}") from None
    if remove_dead_socket(uds):
        log.info("engine_socket.removed", path=str(uds), why="a killed vLLM's socket: vLLM would not bind over it")


def remove_dead_socket(path: Path) -> bool:
    """True when a socket nobody listens on was removed; False when there was nothing at `path`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"child.argv --uds {path}: the path holds something that is not a socket; remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(CONNECT_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        pass  # nobody listens: a dead server's socket
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise NoPermission(f"child.argv --uds {path}: cannot tell whether a server listens: {exc}") from None
    else:
        raise AnotherInstance(f"child.argv --uds {path}: another server listens on it; nothing was changed")
    finally:
        probe.close()
    path.unlink(missing_ok=True)
    return True
