"""A pytest plugin that fails the run when the suite touched the host's own paths.

On a GPU host where the service runs, a test writing `/run/kimi-supervisor` takes the service's port lock and
overwrites its state file, and one writing `/var/lib/kimi-supervisor` appends to its history: `status` and the
metrics then lie.  Every supervisor a test starts gets its own `[paths]`; this guard is what keeps it so.

It compares a snapshot taken when the session starts with one taken when it ends (the host may already hold
these paths, e.g. a real service or `bash .ci/setup`): anything created, removed or changed in between fails the
run, naming the path.  In `/dev/shm` only files named like ours (vLLM's and the nspawn tier's) that appeared
during the session, still exist and that no live process holds, for SETTLE_S, count: another program's live
files are not ours, and a held file is still in use.  The nspawn tier's directories also carry this session's tag
(`KIMI_TEST_SESSION`): a second suite running beside this one on a shared CI machine has its own.

The paths are injectable (`KIMI_HOST_GUARD_PATHS`, `KIMI_HOST_GUARD_SHM`) so that the test proving the guard
works (tests/test_host_guard.py) points it at a scratch directory and never writes a real host path.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
import time
import uuid
from collections.abc import Callable

import pytest

PROTECTED = ("/run/kimi-supervisor", "/var/lib/kimi-supervisor", "/etc/systemd/system")
SHM_DIR = "/dev/shm"
# What the suite's processes name their /dev/shm files: vLLM / torch / multiprocessing (the preflight's own
# globs) and the nspawn tier's container roots (tests/nspawn/nspawn.py).
SHM_GLOBS = ("psm_*", "sem.mp-*", "nccl-*", "kimi-nspawn-*", "kimi-test-*")
# Our own unit files: their contents count too, not only their mtimes (a rewrite within one mtime tick).
OUR_UNITS = ("kimi-supervisor*",)
# The nspawn tier's directories carry the session's tag (tests/nspawn/nspawn.py): on a shared CI machine a
# second suite's containers come and go in the same /dev/shm, and they are that suite's to judge, not ours.
SESSION_ENV = "KIMI_TEST_SESSION"
TAGGED_GLOBS = ("kimi-nspawn-*",)
# A vLLM or multiprocessing file can be seen in the instant between its last holder letting go and its unlink
# (multiprocessing's resource tracker unlinks a semaphore after its owner exits; a second suite beside this one
# makes such files all the time): one must stay unheld this long to count as left behind. A real leak stays.
SETTLE_S = 5.0
SETTLE_POLL_S = 0.1
MAX_DEPTH = 3  # /etc/systemd/system/<target>.wants/<unit>: deeper trees are not systemd's layout

Entry = tuple[str, int, int, str]  # kind, size, mtime_ns, content digest (our unit files only)


def claim_session() -> str:
    """This run's tag, set once in the controller before xdist starts its workers (they inherit it)."""
    return os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex[:12])


def session_tag() -> str:
    return os.environ.get(SESSION_ENV, "solo")


def protected_paths() -> tuple[str, ...]:
    raw = os.environ.get("KIMI_HOST_GUARD_PATHS")
    return tuple(p for p in raw.split(os.pathsep) if p) if raw is not None else PROTECTED


def shm_dir() -> str:
    return os.environ.get("KIMI_HOST_GUARD_SHM", SHM_DIR)


def _entry(path: str, st: os.stat_result) -> Entry:
    kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
    digest = ""
    if kind == "file" and any(fnmatch.fnmatch(os.path.basename(path), g) for g in OUR_UNITS):
        try:
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read(1 << 20)).hexdigest()
        except OSError as exc:
            digest = f"unreadable: {exc.strerror}"
    # A directory's own mtime moves when an entry is added or removed: listed with its entries, so skip it.
    return kind, st.st_size if kind != "dir" else 0, st.st_mtime_ns if kind != "dir" else 0, digest


def snapshot_tree(root: str) -> dict[str, Entry]:
    """Every entry under `root` (not following symlinks), `root` itself included; {} when it does not exist."""
    out: dict[str, Entry] = {}
    try:
        out[root] = _entry(root, os.lstat(root))
    except FileNotFoundError:
        return out
    stack = [(root, 0)]
    while stack:
        path, depth = stack.pop()
        if depth >= MAX_DEPTH or out[path][0] != "dir":
            continue
        try:
            with os.scandir(path) as it:
                for de in it:
                    try:
                        out[de.path] = _entry(de.path, de.stat(follow_symlinks=False))
                    except FileNotFoundError:
                        continue
                    stack.append((de.path, depth + 1))
        except OSError as exc:
            out[path + "/"] = ("unreadable", 0, 0, exc.strerror or "")
    return out


def diff(before: dict[str, Entry], after: dict[str, Entry]) -> list[str]:
    lines = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            lines.append(f"created: {path}")
        elif path not in after:
            lines.append(f"removed: {path}")
        elif before[path] != after[path]:
            lines.append(f"changed: {path}")
    return lines


def is_ours(name: str, tag: str) -> bool:
    if not any(fnmatch.fnmatch(name, g) for g in SHM_GLOBS):
        return False
    if any(fnmatch.fnmatch(name, g) for g in TAGGED_GLOBS):
        return f"-{tag}-" in name
    return True


def shm_names(directory: str, tag: str) -> set[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {n for n in names if is_ours(n, tag)}


def held_files(directory: str) -> set[str]:
    """Files under `directory` some live process has open or mapped (best effort: what /proc lets us read)."""
    held: set[str] = set()
    prefix = os.path.realpath(directory) + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if with_target.startswith(prefix):
                    held.add(with_target[len(prefix) :].removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps", "rb") as fh:
                for line in fh:
                    where = line.find(prefix.encode())
                    if where >= 0:
                        held.add(line[where + len(prefix) :].decode(errors="replace").rstrip("\n"))
        except OSError:
            continue
    return held


class HostPathGuard:
    """Snapshots at session start, compares at session finish; in the xdist controller (or a plain run) only."""

    def __init__(
        self,
        paths: tuple[str, ...],
        shm: str,
        tag: str,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        self.paths = paths
        self.shm = shm
        self.tag = tag
        self.clock = clock
        self.pause = pause
        self.before: dict[str, dict[str, Entry]] = {}
        self.shm_before: set[str] = set()

    def start(self) -> None:
        self.before = {p: snapshot_tree(p) for p in self.paths}
        self.shm_before = shm_names(self.shm, self.tag)

    def problems(self) -> list[str]:
        found = []
        for path in self.paths:
            found += diff(self.before[path], snapshot_tree(path))
        found += [f"left behind: {os.path.join(self.shm, n)}" for n in sorted(self.left_in_shm())]
        return found

    def left_in_shm(self) -> set[str]:
        """Our names new since the start that no live process holds, and that stay so for SETTLE_S."""
        left = shm_names(self.shm, self.tag) - self.shm_before
        deadline = self.clock() + SETTLE_S
        while left:
            left -= held_files(self.shm)
            if not left or self.clock() >= deadline:
                break
            self.pause(SETTLE_POLL_S)
            left &= shm_names(self.shm, self.tag)  # gone meanwhile: unlinked by its owner, not left behind
        return left


_GUARD = pytest.StashKey[HostPathGuard]()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker: the controller snapshots the whole run


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_worker(session.config):
        return
    guard = HostPathGuard(protected_paths(), shm_dir(), session_tag())
    guard.start()
    session.config.stash[_GUARD] = guard


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    guard = session.config.stash.get(_GUARD, None)
    if guard is None:
        return
    problems = guard.problems()
    if not problems:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    text = "\n".join(
        ["the test suite touched the host's own paths (every supervisor a test starts needs its own [paths]):"]
        + [f"  {p}" for p in problems[:50]]
        + ([f"  ... {len(problems) - 50} more"] if len(problems) > 50 else [])
    )
    if reporter is not None:
        reporter.write_sep("=", "host path guard", red=True)
        reporter.write_line(text)
    else:  # pragma: no cover - terminal reporting disabled
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
