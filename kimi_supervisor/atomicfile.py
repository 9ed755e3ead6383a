"""Replace a file atomically: a reader sees the old bytes or the new ones, never half.

The state file, the run history and the metrics textfile are all read by other
processes (the `status` command, node_exporter) while the supervisor rewrites
them.  Written to a temporary file in the same directory, fsynced, given its
mode explicitly (the unit's `UMask=0027` would otherwise hide it from a
non-root reader), then renamed over the target.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def ensure_directory(path: Path, mode: int = 0o755) -> None:
    """Create `path` (and parents) readable by all when missing; an existing directory keeps its mode.

    systemd creates RuntimeDirectory= and StateDirectory= 0755; created here (outside systemd) the
    umask would decide, and `UMask=0027` makes them 0750: a non-root `status` could not read them.
    """
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        os.chmod(directory, mode)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically; raises OSError (the target is then untouched)."""
    # Hidden and not ending in .json/.prom: readers globbing the directory never pick it up.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The rename itself survives a crash only once the directory is on disk too.
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
