"""The weight holder's socket directory, made by the supervisor for the child's account before the spawn.

vLLM 0.32's daemon makes its socket directory itself (`os.makedirs(dir, 0o700, exist_ok=True)`) and checks it
is a real directory owned by its own uid (weight_cache/protocol.py ensure_private_socket_dir and
verify_private_dir, ~154-186), but only after the whole load, and inside `<runtime>/<name>`, which is root's
and 0755: a holder with `child.user` got EACCES after ~9 minutes of loading, every start.  So the supervisor
makes `<runtime>/<name>/weight-cache` first, 0700 and owned by the child's account, through descriptors that
follow no link (files/privdir.py).  A symlink or another account's directory at that name is refused: exit 78
naming it.  The engine checks the same ownership before it connects (ipc_loader.py _connect,
verify_socket_owner) and the daemon refuses other uids by SO_PEERCRED, so the holder records the uid in its
state file and an engine of another account is refused before it starts (lifecycle/holderwait.py).
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.child.spawnplan import Identity, uid_gid
from kimi_supervisor.exitcodes import ConfigError, NoPermission
from kimi_supervisor.files import privdir


def prepare_socket_dir(socket_dir: Path, identity: Identity | None, *, create: bool = True) -> privdir.PrivateDir:
    """The holder's socket directory, the child's alone; `create` False (a dry run) only looks."""
    uid, gid = uid_gid(identity)
    try:
        return privdir.private_dir(socket_dir.parent, socket_dir.name, uid, gid, create=create)
    except privdir.Refused as exc:
        raise ConfigError(f"weight holder socket directory {exc.message}") from None
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not create:  # the dry run: the start makes <runtime>/<name>
            return privdir.PrivateDir(socket_dir, False, False)
        raise NoPermission(f"cannot make the weight holder's socket directory {socket_dir}: {exc.strerror}") from None
