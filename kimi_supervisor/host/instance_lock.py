"""One kimi-supervisor per GPU: flock(2) files under `paths.runtime_directory`.

Taken before any preflight action and held for the process lifetime, so a
second supervisor started by mistake (from a shell while the unit serves,
or a restart racing a stop) exits at once with code 16 and changes nothing,
instead of reaping the serving tree's workers as stale.

Per GPU, not per host: one file per NVML index (`gpu-<index>.lock`), plus one
for the serving port (`port-<port>.lock`, which is all a CPU deployment with
`preflight.gpus = []` locks; its child's NCCL RAS port takes a file of the same kind), one for the
deployment's name and one for its metrics textfile (the files named after them are its own: `Resources`).
All in one host-wide directory, since GPUs and ports are
host-wide, whatever deployment's own files sit below it.  Two deployments on disjoint GPUs and ports run
side by side; any overlap refuses.  flock is released by the kernel when the
owner's last descriptor closes, so a SIGKILLed supervisor never leaves a lock
that blocks (its file stays, empty of meaning); the descriptors are O_CLOEXEC
so vLLM's tree never inherits them and cannot keep a dead supervisor's lock.

A deployment's holder (role "weights", `vllm preload`: docs/weight-holder.md) shares its engine's GPUs by design: it
takes the same resources under its own suffix (`gpu-0.weights.lock`, `deployment-NAME.weights.lock`), so a
second holder refuses as a second engine does, and each of the two, once its own locks are held and its record
written, looks at the other suffix's GPU locks: one held by a supervisor of another deployment (or of one its
record does not name yet) refuses with 16 too.  Both write before they look, so of two racing starts the one
that looks last sees the other's record: never two deployments on one GPU.

The owner's PID is read from /proc/locks (what the kernel says holds the
lock), and its systemd unit from /proc/PID/cgroup; the JSON the owner writes
into the file adds what it serves, and its PID and start time: where /proc/locks
shows no locker (the owner is in a PID namespace this one cannot see), the recorded
PID is named only while a process with that start time holds it.  A dry run only reads these: it never
takes a lock, so it cannot make a real start beside it refuse.

Only a root kimi-supervisor's lock counts.  flock(2) needs nothing but a
read-only descriptor, so any user who can open a lock file can hold it: a
locker that is not a kimi-supervisor run by root (uid 0 in /proc/PID/status,
kimi-supervisor's argv) is named in one warning and set aside, the file
replaced by a fresh one (rename(2) over it, under `.replace.lock`), and it
shields nothing from the reaper.  The files are 0600 (existing ones repaired,
through the descriptor opened with O_NOFOLLOW), so after that nobody else
can open them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path

from kimi_supervisor.exitcodes import AnotherInstance, RuntimeDirectoryError
from kimi_supervisor.host.procident import ProcIdent, identify, same_process
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.roles import Role
from kimi_supervisor.untrusted_json import parse_json

LOCKS = "/proc/locks"
# How a running kimi-supervisor looks in the process table: the console script, or python running it.
SUPERVISOR_ARGV = re.compile(
    r"^(\S*/)?(kimi-supervisor|python[0-9.]*( -\S+)* ((\S*/)?kimi-supervisor|-m kimi_supervisor))( |$)"
)
REPLACE_LOCK = ".replace.lock"  # held while a foreign locker's lock file is replaced
REPLACE_WAIT_S = 2.0
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
    deployment: str | None = None  # what the owner wrote it is (None: not written yet, or by an older supervisor)

    def who(self) -> str:
        who = f"PID {self.pid}" if self.pid is not None else "PID unknown"
        return f"{who}, unit {self.unit}" if self.unit else who

    def serves(self) -> str:
        gpus = f"GPUs {list(self.gpus)}" if self.gpus else "no GPU"
        return f"{gpus}, port {self.port}" if self.port is not None else gpus


@dataclasses.dataclass(frozen=True)
class Locker:
    """A process the kernel lists as holding a flock, as /proc shows it."""

    pid: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem; () when /proc could not tell
    command: str

    @property
    def is_root_supervisor(self) -> bool:
        return bool(self.uids) and all(u == 0 for u in self.uids) and bool(SUPERVISOR_ARGV.search(self.command))

    def describe(self) -> str:
        uid = f"uid {self.uids[1]}" if len(self.uids) > 1 else "uid unknown"
        command = self.command[:120] if self.command else "?"
        return f"PID {self.pid} ({uid}, {command!r})"


def locker(pid: int, proc_root: str = "/proc") -> Locker:
    uids: tuple[int, ...] = ()
    command = ""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"{proc_root}/{pid}/status").read_text(errors="replace").splitlines():
            if line.startswith("Uid:"):
                uids = tuple(int(x) for x in line.split()[1:])
    with contextlib.suppress(OSError):
        raw = Path(f"{proc_root}/{pid}/cmdline").read_bytes()
        command = " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)
    return Locker(pid, uids, command)


def is_root_supervisor(pid: int, proc_root: str = "/proc") -> bool:
    return locker(pid, proc_root).is_root_supervisor


# The weight holder's locks, beside its engine's: its role's file suffix (roles.py), the one definition.
_HOLDER = Role.WEIGHTS.file_suffix
# The supervisors of one deployment that share its GPUs, each under its role's suffix: the engine, its weight
# holder and its hot spare (docs/spare.md).
SHARING = (Role.ENGINE.file_suffix, _HOLDER, Role.SPARE.file_suffix)


_WHAT = {_HOLDER: " (weight holder)", Role.SPARE.file_suffix: " (spare)"}


def partner_suffixes(suffix: str) -> tuple[str, ...]:
    """The suffixes of the other supervisors that may share these GPUs, when they are of the same deployment."""
    return tuple(s for s in SHARING if s != suffix) if suffix in SHARING else ()


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one supervisor owns on the host, as its role names it (deployment/base.py `lock_resources`): the start
    takes these locks (`acquire`), the dry run only looks at them (`find_owner`).

    Its GPUs and port, and (docs/configuration.md) its deployment's name, which names its state file and history
    (config/layout.py), and its metrics textfile, which node_exporter reads whoever writes it.  A second
    deployment of the same name, or one writing the same textfile, would share those files: it is refused like
    one on the same GPU.  `suffix`: its role's file suffix (roles.py), e.g. the weight holder's, which shares its
    own deployment's engine's GPUs under names of its own."""

    directory: Path  # paths.runtime_directory: host-wide, every deployment's locks
    gpus: tuple[int, ...]
    port: int | None  # None: an engine on vLLM's --uds socket binds no TCP port (its front does, docs/front.md)
    deployment: str | None = None
    textfile: Path | None = None
    suffix: str = ""
    # A group node's status endpoint (docs/multi-node.md): two group deployments on one host with the default
    # cluster.status_port refuse here (16), before either binds it.
    status_port: int | None = None
    # NCCL's RAS endpoint (config/gpu_pinning.py) is a host-wide TCP port like the serving port: the same file,
    # so it collides with another supervisor's serving port as well as with its RAS port.
    ras_port: int | None = None

    def locks(self) -> list[Resource]:
        """One lock file per resource, in the order they are taken."""
        what = _WHAT.get(self.suffix, "")
        suffix = self.suffix
        found = [Resource(f"GPU {i}{what}", f"gpu-{i}{suffix}.lock") for i in sorted(set(self.gpus))]
        if self.port is not None:
            found.append(Resource(f"port {self.port}", f"port-{self.port}.lock"))
        if self.deployment is not None:
            found.append(Resource(f"deployment {self.deployment}{what}", f"deployment-{self.deployment}{suffix}.lock"))
        if self.textfile is not None:
            digest = hashlib.sha256(os.fsencode(os.path.abspath(self.textfile))).hexdigest()[:16]
            found.append(Resource(f"metrics textfile {self.textfile}", f"textfile-{digest}.lock"))
        if self.status_port is not None:
            found.append(Resource(f"status port {self.status_port}", f"status-port-{self.status_port}.lock"))
        if self.ras_port is not None:
            found.append(Resource(f"port {self.ras_port}", f"port-{self.ras_port}.lock"))
        return found


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


def flock_lockers(path: Path | int, locks: str = LOCKS) -> set[int]:
    """PIDs the kernel lists as holding a flock on `path` (or an open descriptor's file; waiters excluded)."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(path, follow_symlinks=False)
        table = Path(locks).read_text()
    except OSError:
        return set()
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    lockers = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
            with contextlib.suppress(ValueError):
                lockers.add(int(fields[4]))
    return lockers


def lock_owners(directory: Path) -> set[int]:
    """Every root kimi-supervisor holding one of our locks in `directory`: the live supervisors on this host.

    Another user's process holding a lock file (a read-only descriptor is enough for flock) is no supervisor:
    it shields nothing from the reaper."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    owners: set[int] = set()
    for name in names:
        if name.endswith(".lock") and name != REPLACE_LOCK:
            owners |= flock_lockers(directory / name)
    return {pid for pid in owners - {-1, 0} if is_root_supervisor(pid)}


def weights_supervisor(directory: Path, deployment: str) -> int | None:
    """The live root kimi-supervisor of `deployment`'s weight holder (it holds `deployment-NAME.weights.lock`)."""
    return supervisor_of(directory, deployment, _HOLDER)


def supervisor_of(directory: Path, deployment: str, suffix: str) -> int | None:
    """The live root kimi-supervisor of `deployment`'s role whose file suffix is `suffix` (roles.py): the one
    holding `deployment-NAME<suffix>.lock`."""
    [resource] = Resources(directory, (), None, deployment, suffix=suffix).locks()
    supervisors = _supervisors_holding(directory, resource)
    return min(supervisors) if supervisors else None


def _owner(directory: Path, resource: Resource, lockers: set[int]) -> Owner:
    data: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = parse_json((directory / resource.filename).read_bytes())
        if isinstance(loaded, dict):
            data = loaded
    pid = min(lockers) if lockers else None
    if pid is None:
        pid = _recorded_pid(data)
    gpus = data.get("gpus")
    port = data.get("port")
    return Owner(
        pid=pid,
        unit=unit_of(pid) if pid is not None else None,
        resource=resource,
        gpus=tuple(g for g in gpus if isinstance(g, int)) if isinstance(gpus, list) else None,
        port=port if isinstance(port, int) else None,
        deployment=data["deployment"] if isinstance(data.get("deployment"), str) else None,  # type: ignore[arg-type]
    )


def _recorded_pid(data: dict[str, object]) -> int | None:
    """The PID the owner recorded, while it still names the process that wrote it (its start time matches).

    Only asked when /proc/locks names no locker: the owner is in a PID namespace this one cannot see (a
    container's supervisor, often its PID 1), so here its number most likely names another process."""
    pid, started = data.get("pid"), data.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(started, (int, float)) or pid <= 0:
        return None
    return pid if same_process(ProcIdent(pid, float(started))) else None


def _supervisors_holding(directory: Path, resource: Resource) -> set[int]:
    lockers = flock_lockers(directory / resource.filename) - {os.getpid(), -1, 0}
    return {pid for pid in lockers if is_root_supervisor(pid)}


def foreign_partner(resources: Resources) -> Owner | None:
    """A supervisor holding one of these GPUs under a partner suffix that is not of this deployment: the sharing
    that docs/weight-holder.md and docs/spare.md allow is a holder, an engine and a spare of the same deployment."""
    for suffix in partner_suffixes(resources.suffix):
        partner = Resources(resources.directory, resources.gpus, None, suffix=suffix)
        for resource in partner.locks():  # the GPUs alone
            supervisors = _supervisors_holding(resources.directory, resource)
            if supervisors:
                owner = _owner(resources.directory, resource, supervisors)
                if resources.deployment is None or owner.deployment != resources.deployment:
                    return owner
    return None


def find_owner(resources: Resources) -> Owner | None:
    """Which root kimi-supervisor holds any of these resources now, without taking a lock (the dry run)."""
    for resource in resources.locks():
        supervisors = _supervisors_holding(resources.directory, resource)
        if supervisors:
            return _owner(resources.directory, resource, supervisors)
    return foreign_partner(resources)


def refusal(owner: Owner, directory: Path) -> str:
    return (
        f"another kimi-supervisor ({owner.who()}) owns {owner.resource.name}, serving {owner.serves()} "
        f"(lock {directory / owner.resource.filename}); nothing was changed"
    )


def partner_refusal(owner: Owner, directory: Path) -> str:
    """A holder and an engine share GPUs only within one deployment."""
    of = f"deployment {owner.deployment!r}" if owner.deployment else "a deployment its lock does not name yet"
    return (
        f"another kimi-supervisor ({owner.who()}) of {of} owns {owner.resource.name}, serving {owner.serves()} "
        f"(lock {directory / owner.resource.filename}); only a weight holder and the engine of one deployment "
        "(and its spare) share GPUs; nothing was changed"
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


def _open_lock(path: Path, flags: int = 0) -> int:
    """Open (or create) a lock file 0600 without following a link; repair an existing one to 0600, root's."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | flags, 0o600)
    except OSError as exc:
        raise RuntimeDirectoryError(f"cannot open the instance lock {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            what = "a hard link" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise RuntimeDirectoryError(f"refusing the instance lock {path}: {what}; remove it")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0):
            os.fchown(fd, 0, 0)
    except OSError as exc:
        os.close(fd)
        raise RuntimeDirectoryError(f"cannot repair the instance lock {path} to 0600: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _try_flock(fd: int, path: Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RuntimeDirectoryError(f"cannot lock {path}: {exc.strerror}") from None
        return False


def _replace(directory: Path, path: Path) -> int:
    """A fresh lock file at `path`, locked: created beside it (O_EXCL, unpredictable name) and renamed over it."""
    tmp = directory / f".{path.name}.{secrets.token_hex(8)}.new"
    fd = _open_lock(tmp, os.O_EXCL)
    try:
        if not _try_flock(fd, tmp):
            raise RuntimeDirectoryError(f"cannot lock the fresh instance lock {tmp}")
        os.rename(tmp, path)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RuntimeDirectoryError(f"cannot replace the instance lock {path}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def _refuse_unless_strangers(fd: int, directory: Path, resource: Resource) -> list[Locker]:
    """FD's lock is held: its lockers when every one is a stranger, not a root kimi-supervisor; else
    AnotherInstance, FD closed (a locker /proc/locks cannot name is refused as one)."""
    lockers = [locker(pid) for pid in sorted(flock_lockers(fd) - {-1, 0})]
    if not lockers or any(h.is_root_supervisor for h in lockers):
        os.close(fd)
        supervisors = {h.pid for h in lockers if h.is_root_supervisor}
        raise AnotherInstance(refusal(_owner(directory, resource, supervisors), directory))
    return lockers


def _take(directory: Path, resource: Resource, log: Logger | None) -> int:
    """The locked descriptor of one resource's file, or AnotherInstance when a root kimi-supervisor holds it."""
    path = directory / resource.filename
    fd = _open_lock(path)
    if _try_flock(fd, path):
        return fd
    _refuse_unless_strangers(fd, directory, resource)
    os.close(fd)
    # Replacing races another supervisor doing the same: one at a time, and look again under the lock.
    guard = _open_lock(directory / REPLACE_LOCK)
    try:
        deadline = time.monotonic() + REPLACE_WAIT_S
        while not _try_flock(guard, directory / REPLACE_LOCK):
            if time.monotonic() > deadline:
                who = "; ".join(locker(p).describe() for p in sorted(flock_lockers(guard) - {-1, 0})) or "unknown"
                raise RuntimeDirectoryError(f"{directory / REPLACE_LOCK} is held by {who}; remove the file")
            time.sleep(0.01)
        fd = _open_lock(path)
        if _try_flock(fd, path):
            return fd
        now = _refuse_unless_strangers(fd, directory, resource)
        os.close(fd)
        names = "; ".join(h.describe() for h in now)
        if log is not None:
            log.warning(
                "instance.foreign_lock",
                lock=str(path),
                locker=names,
                why="not a kimi-supervisor run by root: not counted, the lock file was replaced",
            )
        return _replace(directory, path)
    finally:
        os.close(guard)


def own_files(resources: Resources, log: Logger | None = None) -> InstanceLock | None:
    """The locks of a deployment's own files alone (its name's, which guards its state file and history, and its
    textfile's), or None when a root kimi-supervisor holds one: then those files are that running supervisor's.
    For a start refused before its run: it records its failure only where it clobbers no live one."""
    directory = resources.directory
    _ensure_directory(directory)
    own = [r for r in resources.locks() if r.filename.startswith(("deployment-", "textfile-"))]
    taken: list[int] = []
    try:
        for resource in own:
            taken.append(_take(directory, resource, log))
    except AnotherInstance:
        for fd in taken:
            os.close(fd)
        return None
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    return InstanceLock(directory, taken)


def acquire(resources: Resources, config: str, log: Logger | None = None) -> InstanceLock:
    """Take every lock, or none: raise AnotherInstance naming the root kimi-supervisor that holds one.
    `config`: the config file's path, recorded in each lock file for whoever finds it held."""
    if log is None:
        from kimi_supervisor.logs.journal import get_logger  # not at import: a dry run only reads the locks

        log = get_logger()
    directory = resources.directory
    _ensure_directory(directory)
    taken: list[int] = []
    try:
        for resource in resources.locks():
            taken.append(_take(directory, resource, log))
        me = identify(os.getpid())
        gpus = sorted(set(resources.gpus))
        record: dict[str, object] = {"pid": os.getpid(), "gpus": gpus, "port": resources.port, "config": config}
        if me is not None:  # a PID is read back as ours only with this start time (_recorded_pid)
            record["start_time"] = me.create_time
        if resources.deployment is not None:
            record["deployment"] = resources.deployment
        for fd in taken:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        # After our record is written (see the module's note on racing starts).
        foreign = foreign_partner(resources)
        if foreign is not None:
            raise AnotherInstance(partner_refusal(foreign, directory))
    except BaseException:
        for fd in taken:
            os.close(fd)
        raise
    return InstanceLock(directory, taken)
