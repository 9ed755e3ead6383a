"""Who the child runs as and which file it executes, resolved before the preflight acts.

A start that cannot happen must kill nothing: a bogus `child.user` or an argv[0]
that is not on the child's PATH used to surface at spawn, after stale processes
had been killed and files removed.  Both are resolved here first.

Dropping privileges is done the way login(1) does: the user's uid, their primary
gid (or `child.group`), their supplementary groups from the group database
(initgroups), and HOME/USER/LOGNAME of the user.  Root's groups never leak.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import stat
from collections.abc import Mapping
from pathlib import Path


class Unresolvable(Exception):
    """`key` (e.g. "user", "argv[0]") cannot be resolved on this host; `message` says why."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


@dataclasses.dataclass(frozen=True)
class Identity:
    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def _lookup_user(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        raise Unresolvable("user", f"no such user {user!r} on this host") from None


def _lookup_group(group: str) -> int:
    try:
        return (grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)).gr_gid
    except (KeyError, OverflowError):
        raise Unresolvable("group", f"no such group {group!r} on this host") from None


def resolve_identity(user: str | None, group: str | None) -> Identity | None:
    """The child's uid, gid and supplementary groups; None keeps the supervisor's own."""
    if user is None:
        return None
    pw = _lookup_user(user)
    gid = _lookup_group(group) if group is not None else pw.pw_gid
    try:
        # The groups the database lists for the user, plus `gid`: what initgroups(3) would set.
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, gid))))
    except OSError as exc:
        raise Unresolvable("user", f"cannot list the groups of {pw.pw_name!r}: {exc.strerror}") from None
    return Identity(pw.pw_name, pw.pw_uid, gid, groups, pw.pw_dir or "/")


def account(identity: Identity | None) -> tuple[str, int]:
    """(name, uid) of the account the child runs as: `child.user`'s, else the supervisor's own."""
    if identity is not None:
        return identity.user, identity.uid
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name, uid
    except KeyError:
        return str(uid), uid


def uid_gid(identity: Identity | None) -> tuple[int, int]:
    """The uid and gid the child runs as: `child.user`'s, else the supervisor's own."""
    return (os.geteuid(), os.getegid()) if identity is None else (identity.uid, identity.gid)


def switch_to(identity: Identity | None) -> Identity | None:
    """The identity to drop to, or None when there is nothing to drop: none asked for, or already that user (an
    unprivileged process could not setgroups anyway)."""
    if identity is None or (identity.uid == os.geteuid() != 0):
        return None
    return identity


def become(identity: Identity) -> None:
    """This process drops to `identity` for good, as the child's spawn does between fork and exec (setgroups,
    then the gid, then the uid: after setuid a process may no longer change its groups); every uid and gid
    (real, effective, saved) is the account's, so root cannot be taken back.  OSError when refused."""
    os.setgroups(list(identity.groups))
    os.setresgid(identity.gid, identity.gid, identity.gid)
    os.setresuid(identity.uid, identity.uid, identity.uid)
    if identity.uid != 0 and os.getresuid() != (identity.uid,) * 3:
        raise PermissionError(f"still uid {os.getresuid()} after dropping to {identity.user!r}")


def identity_environment(identity: Identity | None) -> dict[str, str]:
    """HOME/USER/LOGNAME for the child's user (child.env still wins)."""
    if identity is None:
        return {}
    return {"HOME": identity.home, "USER": identity.user, "LOGNAME": identity.user}


def _permits(st: os.stat_result, identity: Identity | None, bits: int) -> bool:
    """Whether the mode bits give BITS (an S_IX* triple's user bit, e.g. S_IXUSR) to the child's user: the
    owner's class if it owns the file, else the group's if one of its groups does, else others' (as the
    kernel decides; ACLs are not read).  Computed from stat for the child, not os.access (the supervisor's)."""
    if identity is None:
        uid, groups = os.geteuid(), {os.getegid(), *os.getgroups()}
    else:
        uid, groups = identity.uid, {identity.gid, *identity.groups}
    mode = st.st_mode
    if st.st_uid == uid:
        return bool(mode & bits)
    if st.st_gid in groups:
        return bool(mode & (bits >> 3))
    return bool(mode & (bits >> 6))


def _is_root(identity: Identity | None) -> bool:
    return (os.geteuid() if identity is None else identity.uid) == 0


def _may_execute(st: os.stat_result, identity: Identity | None) -> bool:
    if not stat.S_ISREG(st.st_mode):
        return False
    if _is_root(identity):
        return bool(st.st_mode & 0o111)  # root needs one execute bit, as execve(2) does
    return _permits(st, identity, stat.S_IXUSR)


def _closed_directory(candidate: str, identity: Identity | None) -> str | None:
    """The first directory on CANDIDATE's path the child may not search (x): execve fails EACCES there.  The
    directories of the path as written and of its real path, so a symlink's target directories count too."""
    if _is_root(identity):
        return None  # CAP_DAC_READ_SEARCH
    seen = set()
    for path in (os.path.abspath(candidate), os.path.realpath(candidate)):
        for directory in reversed(Path(path).parents):
            if directory in seen:
                continue
            seen.add(directory)
            try:
                st = os.stat(directory)
            except OSError:
                continue  # the stat of the file itself said what is missing
            if not _permits(st, identity, stat.S_IXUSR):
                return str(directory)
    return None


def resolve_executable(argv0: str, env: Mapping[str, str], cwd: str | None, identity: Identity | None) -> str:
    """The absolute path execve will run for argv0, searched on the child's PATH like execvp."""
    if "/" in argv0:
        candidates = [os.path.join(cwd, argv0) if cwd and not argv0.startswith("/") else argv0]
        where = ""
    else:
        path = env.get("PATH", os.defpath)
        candidates = [os.path.join(d or ".", argv0) for d in path.split(os.pathsep)]
        where = f" on the child's PATH ({path[:200]})"
    who = f"user {identity.user!r}" if identity else "the supervisor's user"
    denied = None
    for candidate in candidates:
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        closed = _closed_directory(candidate, identity)
        if closed is not None:
            denied = denied or f"{candidate} is in {closed}, a directory {who} may not search (no x permission)"
        elif _may_execute(st, identity):
            return os.path.abspath(candidate)
        denied = denied or f"{candidate} is not an executable file for {who}"
    if denied is not None:
        raise Unresolvable("argv[0]", denied)
    raise Unresolvable("argv[0]", f"{argv0!r} not found{where}")


# A credential is a key or token: anything larger is not one (and is not read into memory).
CREDENTIAL_MAX_BYTES = 64 * 1024


def credential_environment(credentials: Mapping[str, str], parent_env: Mapping[str, str]) -> dict[str, str]:
    """child.credentials' variables with their values, read from systemd's $CREDENTIALS_DIRECTORY (the unit's
    LoadCredential=, which install-unit writes): the secret reaches the child's environment only, never argv,
    the config file or a log.  One trailing newline is dropped (`echo KEY > /etc/credstore/NAME` writes one).
    Unresolvable (exit 78, before the preflight acts) when one cannot be read."""
    if not credentials:
        return {}
    directory = parent_env.get("CREDENTIALS_DIRECTORY")
    out: dict[str, str] = {}
    for variable, name in credentials.items():
        key = f"credentials.{variable}"
        if not directory:
            raise Unresolvable(
                key,
                f"credential {name!r}: $CREDENTIALS_DIRECTORY is not set (run under the unit install-unit writes, "
                f"whose LoadCredential={name} reads /etc/credstore/{name}; docs/configuration.md)",
            )
        out[variable] = _read_credential(Path(directory) / name, key, name)
    return out


def _read_credential(path: Path, key: str, name: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise Unresolvable(key, f"credential {name!r}: cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > CREDENTIAL_MAX_BYTES:
            raise Unresolvable(key, f"credential {name!r}: {path} is not a regular file of at most 64 KiB")
        data = os.read(fd, CREDENTIAL_MAX_BYTES + 1)
    finally:
        os.close(fd)
    # The value is never quoted in a message: only what is wrong with it.
    try:
        value = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unresolvable(key, f"credential {name!r}: {path} is not UTF-8 text") from None
    value = value[:-1] if value.endswith("\n") else value
    if not value or "\0" in value:
        raise Unresolvable(key, f"credential {name!r}: {path} is empty or holds a NUL byte")
    return value


def credential_values(credentials: Mapping[str, str], parent_env: Mapping[str, str]) -> tuple[str, ...]:
    """The values that can be read now, for the redaction of every log line and STATUS= (cli/entry.py); one
    that cannot is no secret to hide yet, and its spawn fails naming it."""
    values: list[str] = []
    for variable, name in credentials.items():
        try:
            values += credential_environment({variable: name}, parent_env).values()
        except Unresolvable:
            continue
    return tuple(values)
