"""Reading files another account may have placed: the state file and the history (docs/fault-matrix.md).

Both live in directories the daemon checks (dirtrust.py), but `status` runs as anyone, against any
`--config`, and a directory can be loosened after the daemon started.  So what is read is treated as input:
  - opened O_NOFOLLOW|O_NONBLOCK and checked on the descriptor (fstat): only a regular file is read, so a
    FIFO cannot block the reader and a link to /dev/zero is not followed (lstat first: a device is never
    even opened, opening some has side effects);
  - at most `max_bytes` are read, whatever the file claims or grows to;
  - parsed by untrusted_json.py, the one parser of JSON from outside: nesting deeper than `max_depth` is
    refused before the parser sees it, and NaN, Infinity and numbers that overflow to them (1e400) are
    refused: no finite time is infinite.
Anything else odd is one `Untrusted` (a ValueError) whose text says what, for a warning or a note.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kimi_supervisor.config.file import file_kind, read_fd_capped
from kimi_supervisor.untrusted_json import Untrusted, parse_json

# Any number a document written by the daemon can hold: epoch seconds, durations, PIDs, counters.
LARGEST = 1e15


def read_capped(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of the regular file at `path`; None when there is none; Untrusted when it is odd.

    OSError (no permission) when it cannot be told whether the file is odd.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        raise Untrusted("is a symbolic link, expected a regular file (links are never followed)")
    if not stat.S_ISREG(mode):
        raise Untrusted(f"is {file_kind(mode)}, expected a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link since the lstat
            raise Untrusted("is a symbolic link, expected a regular file (links are never followed)") from None
        raise  # no permission, say: the file may be fine, it is not set aside
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"is {file_kind(st.st_mode)}, expected a regular file")
        if st.st_size > max_bytes:
            raise Untrusted(f"{st.st_size} bytes, larger than the {max_bytes}-byte limit")
        try:
            data = read_fd_capped(fd, max_bytes)
        except OSError as exc:  # EIO, EISDIR on odd filesystems: the bytes cannot be had
            raise Untrusted(f"cannot read it: {exc.strerror}") from None
        if data is None:
            raise Untrusted(f"larger than the {max_bytes}-byte limit")
        return data
    finally:
        os.close(fd)


def read_json(path: Path, *, max_bytes: int, max_depth: int) -> object | None:
    raw = read_capped(path, max_bytes)
    return None if raw is None else parse_json(raw, max_depth)


# -- shape checks for documents that are then rendered ---------------------------------


def number(value: object, where: str, *, optional: bool = True, lo: float = 0.0, hi: float = LARGEST) -> None:
    """A finite int or float (not a bool) within [lo, hi], or None when `optional`."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Untrusted(f"{where}: expected a number, got {type(value).__name__}")
    if not (lo <= value <= hi):  # NaN fails this too
        raise Untrusted(f"{where}: {value!r:.40} is out of range [{lo:g}, {hi:g}]")


def integer(value: object, where: str, *, optional: bool = True, lo: int = 0, hi: int = int(LARGEST)) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise Untrusted(f"{where}: expected an integer, got {type(value).__name__}")
    number(value, where, optional=False, lo=lo, hi=hi)


def string(value: object, where: str, *, optional: bool = True, longest: int = 4000) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise Untrusted(f"{where}: expected a string, got {type(value).__name__}")
    if len(value) > longest:
        raise Untrusted(f"{where}: longer than {longest} characters")


def boolean(value: object, where: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise Untrusted(f"{where}: expected true or false, got {type(value).__name__}")


def mapping(value: object, where: str, *, optional: bool = True) -> dict[str, object]:
    """The object at `where` ({} for an allowed null)."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise Untrusted(f"{where}: expected an object, got {type(value).__name__}")
    return value


def items(value: object, where: str, *, longest: int = 4096) -> list[object]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Untrusted(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > longest:
        raise Untrusted(f"{where}: more than {longest} entries")
    return value
