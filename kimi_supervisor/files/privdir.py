"""A directory root makes for one account, through descriptors that follow no link (docs/weight-holder.md).

Root makes directories that a child's account then uses alone: its cache home (child/cachedirs.py) and the
weight holder's socket directory (child/socketdir.py).  Each is made in a directory only root may write, with
mkdirat and an open with O_NOFOLLOW|O_DIRECTORY relative to that directory's descriptor, then given away with
fchown on the new descriptor: a symlink planted at the name is refused, never followed, and root's chown can
never be steered to another file.  An existing directory is used only when the account owns it and no group
or other may write it; anything else is refused, not repaired: what it holds (compiled code, a socket) may
come from whoever owned it, and only the operator can say whether that can be thrown away.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import stat
from pathlib import Path

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_OPEN_LOOK = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC  # fstat only


class Refused(Exception):
    """The name holds something the account may not be handed; `message` says what and how to fix it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass(frozen=True)
class PrivateDir:
    path: Path
    exists: bool  # False only when asked not to create it (a dry run): it would be made
    made: bool  # made by this call (mode 0700, owned by the account)


def account_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _what_is(parent_fd: int, name: str) -> str:
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError as exc:
        return f"cannot be opened ({exc.strerror})"
    return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"


def private_dir(parent: Path, name: str, uid: int, gid: int, *, create: bool = True, mode: int = 0o700) -> PrivateDir:
    """`parent/name`, a directory only `uid` may write (made `mode`, 0700 unless told, when missing and `create`).

    Raises Refused for a link, a non-directory, another owner or a group/other-writable mode; OSError when
    `parent` is missing or the directory cannot be made (EACCES, EROFS)."""
    path = parent / name
    parent_fd = os.open(parent, _OPEN_DIR)  # root's own, checked directory: its path may hold links
    try:
        made = False
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
                made = True
            except FileExistsError:
                pass
        try:
            # One we made is root's to chown; one that exists is only looked at, through O_PATH, which needs no
            # read permission on it: root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (the front's unit) could not
            # open the child's 0700 directory otherwise, and called it "not a directory".
            fd = os.open(name, (_OPEN_DIR if made else _OPEN_LOOK) | os.O_NOFOLLOW, dir_fd=parent_fd)
        except FileNotFoundError:
            if create:
                raise
            return PrivateDir(path, False, False)
        except OSError:
            raise Refused(f"{path} {_what_is(parent_fd, name)}; remove it (it is not ours to follow)") from None
        try:
            if made:
                try:
                    os.fchown(fd, uid, gid)
                    os.fchmod(fd, mode)  # the umask may have taken more than group and other
                except OSError:
                    # Not left behind root's: the next start would refuse it (another owner) rather than try
                    # again (a unit without CAP_CHOWN refuses the handover: docs/hardening.md).
                    os.rmdir(name, dir_fd=parent_fd)
                    raise
            st = os.fstat(fd)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)
    if st.st_uid != uid:
        raise Refused(
            f"{path} is owned by {account_name(st.st_uid)}, not {account_name(uid)}; remove it (rm -r {path}), "
            "it is made again at the next start"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Refused(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 0700 {path}")
    return PrivateDir(path, True, made)
