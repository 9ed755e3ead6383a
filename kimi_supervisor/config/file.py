"""Reading the config file safely: the bytes root will act on come only from root.

The file decides which argv root runs, so it is read the way sshd's StrictModes
reads authorized_keys:
  - symlinks are resolved first and the *target* is what gets checked;
  - it is opened with O_NOFOLLOW|O_NONBLOCK (a FIFO cannot block us) and every
    check is made on the open descriptor (fstat), which is also what is read:
    nothing can be swapped in between the check and the read;
  - only a regular file is accepted (not a FIFO, /dev/zero, a socket);
  - at most MAX_BYTES are read, whatever the file claims or grows to;
  - running as root: the file and every directory on its resolved path are
    owned by root and not writable by group or others.  A sticky directory
    (/tmp) is the one exception: there only an entry's owner (root, checked
    next) can rename or remove it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kimi_supervisor.exitcodes import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: the shipped config is 3 KiB


def file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _check_owner(path: str, st: os.stat_result, subject: str, shown: Path) -> None:
    """`subject` is "" for the file itself, else e.g. "directory /etc/kimi is"."""
    if st.st_uid != 0:
        raise ConfigError(
            f"{shown}: {subject}owned by uid {st.st_uid}, not root; "
            f"refusing it while running as root (chown root {path})"
        )
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if writable and not sticky_dir:
        raise ConfigError(
            f"{shown}: {subject}writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"refusing it while running as root (chmod go-w {path})"
        )


def _check_directories(real: str, shown: Path) -> None:
    parent = os.path.dirname(real)
    while True:
        try:
            st = os.stat(parent)
        except OSError as exc:
            raise ConfigError(f"{shown}: cannot check directory {parent}: {exc.strerror}") from None
        _check_owner(parent, st, f"directory {parent} is ", shown)
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def read_config_bytes(path: Path, *, as_root: bool | None = None, max_bytes: int = MAX_BYTES) -> bytes:
    """The file's bytes, or a one-line ConfigError saying why they cannot be trusted or read."""
    root = os.geteuid() == 0 if as_root is None else as_root
    try:
        real = os.path.realpath(path, strict=True)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (use --config PATH)") from None
    except OSError as exc:  # a symlink loop, a component that is not a directory, no permission
        raise ConfigError(f"{path}: cannot resolve config path: {exc.strerror}") from None
    shown_target = "" if real == os.path.abspath(path) else f" (resolves to {real})"
    try:
        # Refused before any open: opening some devices has side effects (a tape rewinds).
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config{shown_target}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{path}: is a directory, expected a TOML file")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: is {file_kind(mode)}{shown_target}, expected a regular TOML file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found (use --config PATH)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config{shown_target}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{path}: is a directory, expected a TOML file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: is {file_kind(st.st_mode)}{shown_target}, expected a regular TOML file")
        if root:
            _check_owner(real, st, f"its target {real} is " if shown_target else "", path)
            _check_directories(real, path)
        if st.st_size > max_bytes:
            raise ConfigError(f"{path}: {st.st_size} bytes, larger than the {max_bytes}-byte limit for a config")
        try:
            data = read_fd_capped(fd, max_bytes)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config{shown_target}: {exc.strerror}") from None
        if data is None:
            raise ConfigError(f"{path}: larger than the {max_bytes}-byte limit for a config")
        return data
    finally:
        os.close(fd)


def read_fd_capped(fd: int, max_bytes: int) -> bytes | None:
    """Everything FD holds, or None past MAX_BYTES: a file growing while it is read is still cut at the cap
    (fstat's size alone is not enough).  OSError from read(2) goes to the caller, which names the file."""
    chunks: list[bytes] = []
    total = 0
    while total <= max_bytes:
        chunk = os.read(fd, max_bytes + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return None if total > max_bytes else b"".join(chunks)
