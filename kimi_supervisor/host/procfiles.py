"""Which files live processes hold: /proc/PID/fd links and /proc/PID/maps names.

Deleting a file some process still uses is data loss, so this fails closed:
a process whose fd or maps cannot be read (not root, hidepid) is recorded in
`unreadable`, and the caller keeps every candidate file.

Names are compared as the kernel shows them, canonical (no symlinks, no `..`),
so callers must canonicalise the directory they ask about.  In maps the kernel
writes a newline in a name as the four bytes `\\012` (and leaves a literal
backslash alone, so `\\012` in a name is ambiguous): both readings count.
"""

from __future__ import annotations

import os


class OpenPaths(dict[str, set[int]]):
    """path -> PIDs holding it; `unreadable`: PID -> why its files could not be listed."""

    def __init__(self) -> None:
        super().__init__()
        self.unreadable: dict[int, str] = {}


def maps_names(raw: bytes) -> list[bytes]:
    """The file names a maps path field may stand for: as written, and with `\\012` read as a newline."""
    if b"\\012" not in raw:
        return [raw]
    return [raw, raw.replace(b"\\012", b"\n")]


def _hidepid(proc_root: str) -> str | None:
    """The hidepid= option of the proc mount at `proc_root`, when processes of others may be hidden."""
    try:
        with open("/proc/self/mountinfo", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4 and os.fsdecode(fields[4]) == proc_root:
            options = b",".join(fields[5:])
            for opt in options.replace(b" ", b",").split(b","):
                if opt.startswith(b"hidepid=") and opt not in (b"hidepid=0", b"hidepid=off"):
                    return os.fsdecode(opt)
    return None


def scan_open_paths(prefixes: tuple[str, ...], proc_root: str = "/proc") -> OpenPaths:
    users = OpenPaths()
    bprefixes = tuple(os.fsencode(p) for p in prefixes)
    hidden = _hidepid(proc_root)
    if hidden and os.geteuid() != 0:
        users.unreadable[0] = f"{proc_root} is mounted with {hidden}: other users' processes are invisible"
    try:
        pids = [int(n) for n in os.listdir(proc_root) if n.isdigit()]
    except OSError as exc:
        users.unreadable[0] = f"cannot list {proc_root}: {exc.strerror}"
        return users
    for pid in pids:
        for path in _fds(proc_root, pid, users) + _maps(proc_root, pid, users):
            if path.startswith(bprefixes):
                users.setdefault(os.fsdecode(path), set()).add(pid)
    return users


def _gone(exc: OSError) -> bool:
    # ENOENT/ESRCH: the process exited while we looked; its files are released.
    return isinstance(exc, (FileNotFoundError, ProcessLookupError))


def _fds(proc_root: str, pid: int, users: OpenPaths) -> list[bytes]:
    base = f"{proc_root}/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError as exc:
        if not _gone(exc):
            users.unreadable[pid] = f"cannot read {base}: {exc.strerror}"
        return []
    paths = []
    for fd in fds:
        try:
            paths.append(os.readlink(os.fsencode(f"{base}/{fd}")))
        except OSError as exc:
            if not _gone(exc):
                users.unreadable[pid] = f"cannot read {base}/{fd}: {exc.strerror}"
    return paths


def _maps(proc_root: str, pid: int, users: OpenPaths) -> list[bytes]:
    name = f"{proc_root}/{pid}/maps"
    try:
        with open(name, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        if not _gone(exc):
            users.unreadable[pid] = f"cannot read {name}: {exc.strerror}"
        return []
    paths = []
    for line in data.splitlines():
        # address perms offset dev inode [path]; anonymous maps have no path.
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(b"/"):
            paths += maps_names(fields[5])
    return paths
