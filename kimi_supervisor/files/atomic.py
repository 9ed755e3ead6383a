"""Replace a file atomically, as root, in a directory someone else might be able to touch (docs/hardening.md).

The state file, the run history and the metrics textfile are all read by other
processes (the `status` command, node_exporter) while the supervisor rewrites
them: a reader sees the old bytes or the new ones, never half.  Written as root,
so nothing about the write may be steered by another account:
  - the directory is opened once and every step is relative to that descriptor,
    which is checked first (owner root or us, not writable by group or others,
    sticky or not): a directory loosened after the start check is refused;
  - the temporary file has an unpredictable name and is created with
    O_CREAT|O_EXCL|O_NOFOLLOW: a link planted at any name is never followed, and
    a planted name is simply skipped;
  - its mode is set on the descriptor (fchmod: the unit's `UMask=0077` would
    otherwise hide it from a non-root reader), it is fsynced, then renamed over
    the target (rename replaces a link planted at the final name, never follows it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

TEMP_ATTEMPTS = 8


class UnsafeDirectory(OSError):
    """The directory is not one root should write in; an OSError so every writer's "unwritable" path takes it."""


def trusted_owners() -> frozenset[int]:
    """Root, and the account the supervisor runs as (a demo run by a user, in that user's directory).

    Not `child.user`: that account runs vLLM, which parses every client's request.
    """
    return frozenset({0, os.geteuid()})


def directory_problem(st: os.stat_result, *, holds_our_files: bool) -> str | None:
    """Why a directory with this stat cannot be trusted, or None.

    A sticky, world-writable directory (/tmp) is fine *above* ours, as sshd's StrictModes and the config
    check allow: there only an entry's owner can rename or remove it.  It is never fine as the directory
    that holds our files: anyone could create the names first, or plant files `status` would believe.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in trusted_owners():
        return f"is owned by uid {st.st_uid}, not root"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and (holds_our_files or not st.st_mode & stat.S_ISVTX):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ensure_directory(path: Path, mode: int = 0o755) -> None:
    """Create `path` (and parents) readable by all when missing; an existing directory keeps its mode.

    systemd creates RuntimeDirectory= and StateDirectory= 0755; created here (outside systemd) the
    umask would decide, and `UMask=0077` makes them 0700: a non-root `status` could not read them.
    """
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)  # private until its mode is set on the descriptor
        except FileExistsError:
            continue  # someone else's: the directory check says whether it can be used
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically; raises OSError (UnsafeDirectory included; the target is then untouched)."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = directory_problem(os.fstat(dfd), holds_our_files=True)
        if problem is not None:
            raise UnsafeDirectory(f"directory {path.parent} {problem}; not writing {path.name} there")
        _replace(dfd, path.name, data, mode)
        # The rename itself survives a crash only once the directory is on disk too.
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)


def _replace(dfd: int, name: str, data: bytes, mode: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(TEMP_ATTEMPTS):
        # Hidden and not ending in .json/.prom: readers globbing the directory never pick it up.
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            break
        except FileExistsError:  # a planted name (a link, a file): never opened, another name is drawn
            continue
    else:
        raise FileExistsError(f"{TEMP_ATTEMPTS} temporary names for {name} were all taken")
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
