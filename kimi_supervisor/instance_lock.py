"""One kimi-supervisor per GPU: flock(2) files under `paths.runtime_directory`.

Taken before any preflight action and held for the process lifetime, so a
second supervisor started by mistake (from a shell while the unit serves,
or a restart racing a stop) exits at once with code 16 and changes nothing,
instead of reaping the serving tree's workers as stale.

Per GPU, not per host: one file per NVML index (`gpu-<index>.lock`), plus one
for the serving port (`port-<port>.lock`, which is all a CPU deployment with
`preflight.gpus = []` locks).  Two deployments on disjoint GPUs and ports run
side by side; any overlap refuses.  flock is released by the kernel when the
owner's last descriptor closes, so a SIGKILLed supervisor never leaves a lock
that blocks (its file stays, empty of meaning); the descriptors are O_CLOEXEC
so vLLM's tree never inherits them and cannot keep a dead supervisor's lock.

The owner's PID is read from /proc/locks (what the kernel says holds the
lock), and its systemd unit from /proc/PID/cgroup; the JSON the owner writes
into the file adds what it serves.  A dry run only reads these: it never
takes a lock, so it cannot make a real start beside it refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.exitcodes import AnotherInstance, RuntimeDirectoryError

LOCKS = "/proc/locks"
_UNIT = re.compile(r"([A-Za-z0-9:_.\\@-]+\.service)(/|$)")


@dataclasses.dataclass(frozen=True)
class Resource:
    name: str  # "GPU 0", "port 8000"
    filename: str  # "gpu-0.lock"


@dataclasses.dataclass(frozen=True)
class Owner:
    pid: int | None  # None: the kernel's lock table did not say (another PID namespace)
    unit: str | None
    resource: Resource
    gpus: tuple[int, ...] | None  # what the owner wrote it serves
    port: int | None

    def who(self) -> str:
        who = f"PID {self.pid}" if self.pid is not None else "PID unknown"
        return f"{who}, unit {self.unit}" if self.unit else who

    def serves(self) -> str:
        gpus = f"GPUs {list(self.gpus)}" if self.gpus else "no GPU"
        return f"{gpus}, port {self.port}" if self.port is not None else gpus


def resources(gpus: Sequence[int], port: int) -> list[Resource]:
    found = [Resource(f"GPU {i}", f"gpu-{i}.lock") for i in sorted(set(gpus))]
    return [*found, Resource(f"port {port}", f"port-{port}.lock")]


def unit_of(pid: int, proc_root: str = "/proc") -> str | None:
    """The systemd unit a process runs in (from its cgroup path), or None."""
    try:
        text = Path(f"{proc_root}/{pid}/cgroup").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        found = _UNIT.findall(path)
        if found:
            return str(found[-1][0])
    return None


def flock_holders(path: Path, locks: str = LOCKS) -> set[int]:
    """PIDs the kernel lists as holding a flock on `path` (waiters, "->" lines, excluded)."""
    try:
        st = path.stat()
        table = Path(locks).read_text()
    except OSError:
        return set()
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            with contextlib.suppress(ValueError):
                holders.add(int(fields[4]))
    return holders


def lock_owners(directory: Path) -> set[int]:
    """Every PID holding one of our locks in `directory`: the live supervisors on this host."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    owners: set[int] = set()
    for name in names:
        if name.endswith(".lock"):
            owners |= flock_holders(directory / name)
    return owners - {-1, 0}


def _owner(directory: Path, resource: Resource, holders: set[int]) -> Owner:
    data: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads((directory / resource.filename).read_text())
        if isinstance(loaded, dict):
            data = loaded
    pid = min(holders) if holders else None
    if pid is None and isinstance(data.get("pid"), int):
        pid = int(data["pid"])  # type: ignore[call-overload]
    gpus = data.get("gpus")
    port = data.get("port")
    return Owner(
        pid=pid,
        unit=unit_of(pid) if pid is not None else None,
        resource=resource,
        gpus=tuple(g for g in gpus if isinstance(g, int)) if isinstance(gpus, list) else None,
        port=port if isinstance(port, int) else None,
    )


def find_owner(directory: Path, gpus: Sequence[int], port: int) -> Owner | None:
    """Who holds any of these resources now, without taking a lock (the dry run)."""
    for resource in resources(gpus, port):
        holders = flock_holders(directory / resource.filename) - {os.getpid()}
        if holders:
            return _owner(directory, resource, holders)
    return None


def refusal(owner: Owner, directory: Path) -> str:
    return (
        f"another kimi-supervisor ({owner.who()}) owns {owner.resource.name}, serving {owner.serves()} "
        f"(lock {directory / owner.resource.filename}); nothing was changed"
    )


def dry_run_text(owner: Owner) -> str:
    return (
        f"a kimi-supervisor ({owner.who()}) is running and owns {owner.serves()}; "
        f"a start now would refuse (exit 16, {owner.resource.name} is taken)"
    )


class InstanceLock:
    """The held locks; keep this object alive for as long as the supervisor runs."""

    def __init__(self, directory: Path, fds: list[int]) -> None:
        self.directory = directory
        self._fds = fds

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def _ensure_directory(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, mode=0o755)
        # mkdir's mode passes through the umask (the unit's is 0027): other tools read the owner from here.
        os.chmod(directory, 0o755)
    except FileExistsError:
        return
    except OSError as exc:
        raise RuntimeDirectoryError(
            f"cannot create {directory} (paths.runtime_directory) for the instance lock: {exc.strerror}"
        ) from None


def acquire(directory: Path, gpus: Sequence[int], port: int, config: str) -> InstanceLock:
    """Take every lock, or none: raise AnotherInstance naming the owner of the first one held."""
    _ensure_directory(directory)
    taken: list[int] = []
    try:
        for resource in resources(gpus, port):
            path = directory / resource.filename
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise RuntimeDirectoryError(f"cannot open the instance lock {path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RuntimeDirectoryError(f"cannot lock {path}: {exc.strerror}") from None
                raise AnotherInstance(refusal(_owner(directory, resource, flock_holders(path)), directory)) from None
            taken.append(fd)
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "gpus": sorted(set(gpus)), "port": port, "config": config}) + "\n"
    for fd in taken:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
    return InstanceLock(directory, taken)
