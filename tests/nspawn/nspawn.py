"""Boot a real systemd inside systemd-nspawn for end-to-end tests.

The container's root file system is an overlay whose lower layer is the host's
``/`` (only the root mount, not its submounts) and whose upper layer lives on a
tmpfs, so everything installed on the host (interpreters, site-packages, the
systemd binaries) is visible inside, and nothing the container writes reaches
the host.

Typical use::

    with NspawnMachine(binds_ro=["/work/main"]) as m:
        m.install_unit("x.service", UNIT_TEXT)
        m.systemctl("start", "x.service")
        assert m.unit_property("x.service", "ActiveState") == "active"

Requirements: root, ``systemd-nspawn`` (Debian package ``systemd-container``),
``nsenter``/``mount``/``umount`` (util-linux) and overlayfs.  See
``NSPAWN_NOTES.md`` next to this file for gotchas and timings.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

__all__ = [
    "NspawnError",
    "NspawnMachine",
    "available",
    "cleanup_stale",
    "expect_no_restart",
    "needs_bind",
    "wait_for",
]

T = TypeVar("T")

#: Where the overlay upper/work dirs go.  Must be a tmpfs (or any non-overlay
#: file system that supports overlay upper dirs) that is NOT the root mount,
#: so it does not show up inside the lower layer.
DEFAULT_BASE_DIR = "/dev/shm"
DIR_PREFIX = "kimi-nspawn-"

#: PATH used for commands run inside the container (the host's PATH is not
#: inherited: pyenv shims and the like would leak in).
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Minimal boot target: basic.target (sysinit: journald, tmpfiles, ...) but
#: none of multi-user.target's wants, so host services (postgresql, getty,
#: cron, ...) that are enabled on the host do not start in the container.
HARNESS_TARGET = "kimi-harness.target"
_HARNESS_TARGET_TEXT = """\
[Unit]
Description=kimi-supervisor nspawn test harness target
Requires=basic.target
After=basic.target
AllowIsolate=yes
"""

#: Units masked by default: timers would otherwise fire "Persistent=" jobs
#: (logrotate, man-db, apt) right after boot and eat CPU during the tests.
DEFAULT_MASK: tuple[str, ...] = ("timers.target",)

#: If set, each machine's console log (boot/shutdown messages) is copied to
#: $KIMI_NSPAWN_LOG_DIR/<name>.console.log on teardown (CI artifacts).
LOG_DIR_ENV = "KIMI_NSPAWN_LOG_DIR"

#: Set to 1 to make available() report False (test the skip/fail path).
DISABLE_ENV = "KIMI_NSPAWN_DISABLE"

# Paths that nspawn (or the container's systemd) mounts over, so host content
# at those paths is NOT visible inside the container and must be bound.
_SHADOWED = ("/tmp", "/run", "/dev", "/proc", "/sys")


class NspawnError(RuntimeError):
    """Setting up, booting or tearing down the container failed."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.1,
    message: str = "condition",
) -> T:
    """Poll ``predicate`` until it returns a truthy value; return that value.

    Raises ``TimeoutError`` after ``timeout`` seconds.  Exceptions raised by the
    predicate propagate immediately.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {message}")
        time.sleep(interval)


_TIMESPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def timespan_s(text: str) -> float:
    """A timespan as `systemctl show` prints it ("500ms", "1min 30s", "0") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(us|ms|min|s|h)?", text.strip())
    if not parts or re.sub(r"[\d.\s]|us|ms|min|s|h", "", text):
        raise ValueError(f"not a systemd timespan: {text!r}")
    return sum(float(n) * _TIMESPAN_UNITS[u or "s"] for n, u in parts)


def expect_no_restart(m: NspawnMachine, unit: str, margin: float = 1.0) -> None:
    """Assert that systemd decided not to restart ``unit``, which has just failed.

    With a restart pending the unit sits in SubState ``auto-restart``, never ``failed``, so
    ``failed`` is the decision itself. To catch a restart that comes anyway, keep checking until
    RestartSec (+ ``margin``) has passed since the unit went inactive by systemd's own timestamp:
    a bound, not a guess of how slow this host is. The container shares the host's CLOCK_MONOTONIC
    (nspawn makes no time namespace), so the host's time.monotonic() compares with it.
    """

    def state() -> tuple[str, ...]:
        return tuple(m.unit_property(unit, p) for p in ("ActiveState", "SubState", "NRestarts"))

    assert state() == ("failed", "failed", "0"), state()
    went_inactive = int(m.unit_property(unit, "InactiveEnterTimestampMonotonic")) / 1e6
    bound = went_inactive + timespan_s(m.unit_property(unit, "RestartUSec")) + margin

    def past_bound() -> bool:
        assert state() == ("failed", "failed", "0"), f"{unit} restarted after all: {state()}"
        return time.monotonic() > bound

    wait_for(past_bound, timeout=max(0.0, bound - time.monotonic()) + 10, interval=0.2, message="RestartSec to pass")


def needs_bind(path: str) -> bool:
    """True if host ``path`` is not visible through the overlay of ``/``.

    That is the case when it lives on another mount than ``/`` (e.g. a venv on
    a separate disk) or below a directory that the container mounts over
    (``/tmp``, ``/run``, ...).
    """
    real = os.path.realpath(path)
    for shadowed in _SHADOWED:
        if real == shadowed or real.startswith(shadowed + "/"):
            return True
    try:
        return os.stat(real).st_dev != os.stat("/").st_dev
    except FileNotFoundError:
        return False


def _mounts_under(path: str) -> list[str]:
    """Mount points at or below ``path`` in our mount namespace, deepest first."""
    prefix = path.rstrip("/")
    found: list[str] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            # Field 5 is the mount point, with octal escapes for odd chars.
            mnt = fields[4].encode().decode("unicode_escape")
            if mnt == prefix or mnt.startswith(prefix + "/"):
                found.append(mnt)
    return sorted(set(found), key=lambda m: m.count("/"), reverse=True)


def _umount_all(path: str) -> list[str]:
    """Unmount everything at/below ``path``; return what could not be unmounted."""
    failed: list[str] = []
    for _attempt in range(3):
        mounts = _mounts_under(path)
        if not mounts:
            return []
        failed = []
        for mnt in mounts:
            r = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                failed.append(mnt)
        if not failed:
            continue
        time.sleep(0.2)
    # Last resort: lazy unmount (detaches now, frees when no longer busy).
    for mnt in _mounts_under(path):
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
    return _mounts_under(path)


def _try_overlay(base_dir: str) -> str | None:
    """Mount and unmount a throwaway overlay of ``/``; return an error or None."""
    try:
        tmp = tempfile.mkdtemp(prefix=DIR_PREFIX + "probe-", dir=base_dir)
    except OSError as e:
        return f"cannot create a directory in {base_dir}: {e}"
    merged = os.path.join(tmp, "merged")
    try:
        for sub in ("upper", "work", "merged"):
            os.mkdir(os.path.join(tmp, sub))
        opts = f"lowerdir=/,upperdir={tmp}/upper,workdir={tmp}/work"
        r = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, merged],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            return f"overlay mount of / failed: {r.stderr.strip() or r.returncode}"
        if not os.path.exists(os.path.join(merged, "usr/lib/systemd/systemd")) and not (
            os.path.exists(os.path.join(merged, "lib/systemd/systemd"))
        ):
            return "systemd (/lib/systemd/systemd) not found in the root file system"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"overlay probe failed: {e}"
    finally:
        left = _umount_all(merged)
        if not left:
            shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def _available(base_dir: str) -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    for tool in ("systemd-nspawn", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            hint = " (apt-get install systemd-container)" if tool == "systemd-nspawn" else ""
            return False, f"{tool} not found in PATH{hint}"
    if not os.path.isdir(base_dir):
        return False, f"{base_dir} does not exist"
    err = _try_overlay(base_dir)
    if err is not None:
        return False, err
    return True, "ok"


def available(base_dir: str = DEFAULT_BASE_DIR) -> tuple[bool, str]:
    """Whether NspawnMachine can run here, and if not, why (cached).

    ``KIMI_NSPAWN_DISABLE=1`` forces "unavailable" (to exercise skip/fail)."""
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return False, f"disabled by {DISABLE_ENV}"
    return _available(base_dir)


def cleanup_stale(base_dir: str = DEFAULT_BASE_DIR) -> list[str]:
    """Unmount and remove leftovers of harness runs whose Python process died
    without tearing down (SIGKILL, OOM).  Only touches ``base_dir/kimi-nspawn-
    <pid>-*`` dirs whose owner <pid> no longer exists and that no running
    systemd-nspawn uses.  Returns the directories removed."""
    removed: list[str] = []
    in_use = ""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            in_use += f.read().decode("utf-8", "replace") + "\n"
    for entry in sorted(os.listdir(base_dir)):
        if not entry.startswith(DIR_PREFIX):
            continue
        owner = entry[len(DIR_PREFIX) :].split("-", 1)[0]
        path = os.path.join(base_dir, entry)
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}") or path in in_use:
            continue
        if not _umount_all(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for mount, own in _cgroup_hierarchies():
        parent = os.path.join(mount, own.lstrip("/"))
        with contextlib.suppress(OSError):
            for entry in os.listdir(parent):
                owner = entry[len(DIR_PREFIX) :].split("-", 1)[0]
                stale = entry.startswith(DIR_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}")
                if stale and _rmdir_tree(os.path.join(parent, entry)):
                    removed.append(os.path.join(parent, entry))
    return removed


def _cgroup_hierarchies() -> list[tuple[str, str]]:
    """(mount point, our cgroup path) for each hierarchy nspawn places containers in: the unified
    one (cgroup2) and the legacy ``name=systemd`` one, whichever this host has."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _source, options = [*post.split(), "", ""][:3]
            mnt = pre.split()[4].encode().decode("unicode_escape")
            if fstype == "cgroup2":
                mounts.setdefault("", mnt)
            elif fstype == "cgroup" and "name=systemd" in options.split(","):
                mounts.setdefault("name=systemd", mnt)
    found: list[tuple[str, str]] = []
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers in mounts:
                found.append((mounts[controllers], path))
    return found


def _pid1_is_systemd() -> bool:
    return _comm(1) == "systemd"


def _rmdir_tree(path: str) -> bool:
    """Remove an empty cgroup and its descendants (deepest first); True when it is gone."""
    for dirpath, _dirs, _files in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not os.path.exists(path)


def _pid_ns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                kids.extend(int(x) for x in f.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return kids


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


class NspawnMachine:
    """A booted systemd container; use as a context manager.

    ``binds_ro``/``binds_rw`` take ``PATH`` (same path inside) or
    ``HOST:CONTAINER`` entries, passed to ``--bind-ro=``/``--bind=``.
    Host paths under /tmp, /run or on other mounts than / are only visible
    inside if bound (see :func:`needs_bind`).
    """

    def __init__(
        self,
        binds_ro: Sequence[str] = (),
        binds_rw: Sequence[str] = (),
        *,
        private_network: bool = True,
        boot_target: str | None = HARNESS_TARGET,
        mask: Sequence[str] = DEFAULT_MASK,
        boot_timeout: float = 60.0,
        shutdown_timeout: float = 20.0,
        base_dir: str = DEFAULT_BASE_DIR,
        extra_nspawn_args: Sequence[str] = (),
        name: str | None = None,
        stop_on_parent_death: bool = True,
    ) -> None:
        self.binds_ro = list(binds_ro)
        self.binds_rw = list(binds_rw)
        self.private_network = private_network
        self.boot_target = boot_target
        self.mask = list(mask)
        self.boot_timeout = boot_timeout
        self.shutdown_timeout = shutdown_timeout
        self.base_dir = base_dir
        self.extra_nspawn_args = list(extra_nspawn_args)
        self.name = name or f"kimi-test-{uuid.uuid4().hex[:8]}"
        self.stop_on_parent_death = stop_on_parent_death

        self.root: Path | None = None  # temp dir holding upper/work/merged/log
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid1: int | None = None
        self._log_path: Path | None = None
        #: Host paths of the cgroups made for this container (see _own_cgroup_argv).
        self.cgroups: list[str] = []
        #: Seconds from starting nspawn to "running"/"degraded".
        self.boot_seconds: float | None = None
        #: `systemctl is-system-running` at the end of boot: running|degraded.
        self.boot_state: str | None = None
        #: Seconds the last teardown took (set by __exit__/close()).
        self.teardown_seconds: float | None = None

    # ------------------------------------------------------------------ paths
    @property
    def merged(self) -> Path:
        """Host path of the container's root overlay (root fs only, no submounts)."""
        if self.root is None:
            raise NspawnError("machine not started")
        return self.root / "merged"

    @property
    def pid1(self) -> int:
        """Host PID of the container's systemd (PID 1 inside)."""
        if self._pid1 is None:
            raise NspawnError("machine not booted")
        return self._pid1

    @property
    def nspawn_pid(self) -> int:
        if self._proc is None:
            raise NspawnError("machine not started")
        return self._proc.pid

    def console_log(self, tail_bytes: int | None = None) -> str:
        """nspawn's stdout/stderr, i.e. the container console (boot messages)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        data = self._log_path.read_bytes()
        if tail_bytes is not None:
            data = data[-tail_bytes:]
        return data.decode("utf-8", "replace")

    # --------------------------------------------------------------- lifecycle
    def __enter__(self) -> NspawnMachine:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        t0 = time.monotonic()
        # <pid>-<session tag>-: the pid lets cleanup_stale() find a dead run's leftovers, the tag lets the host
        # path guard tell this suite's directories from those of a second suite on the same machine.
        tag = os.environ.get("KIMI_TEST_SESSION", "solo")
        self.root = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-{tag}-", dir=self.base_dir))
        for sub in ("upper", "work", "merged"):
            (self.root / sub).mkdir()
        opts = f"lowerdir=/,upperdir={self.root}/upper,workdir={self.root}/work"
        r = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(self.merged)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            raise NspawnError(f"overlay mount failed: {r.stderr.strip()}")
        self._prepare_rootfs()

        argv = [
            "systemd-nspawn",
            "--quiet",
            f"--directory={self.merged}",
            f"--machine={self.name}",
            "--boot",
            "--register=no",
            "--keep-unit",
            "--link-journal=no",
            "--console=read-only",
        ]
        if self.private_network:
            argv.append("--private-network")
        argv += [f"--bind-ro={b}" for b in self.binds_ro]
        argv += [f"--bind={b}" for b in self.binds_rw]
        argv += self.extra_nspawn_args
        argv += ["--", "systemd.firstboot=off", "systemd.show_status=1"]
        if self.boot_target:
            argv.append(f"systemd.unit={self.boot_target}")
        # If this Python process dies without tearing down, nspawn gets SIGTERM
        # and halts the container (the overlay mount is then left behind; see
        # cleanup_stale()).  PDEATHSIG fires when the *thread* that started the
        # machine exits: start it from a long-lived thread (pytest's main
        # thread is fine) or pass stop_on_parent_death=False.
        if self.stop_on_parent_death and shutil.which("setpriv"):
            argv = ["setpriv", "--pdeathsig", "TERM", "--", *argv]
        argv = self._own_cgroup_argv(argv)

        self._log_path = self.root / "console.log"
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = t0 + self.boot_timeout
        self._pid1 = self._find_pid1(deadline)
        self._wait_running(deadline)
        self.boot_seconds = time.monotonic() - t0

    def _own_cgroup_argv(self, argv: list[str]) -> list[str]:
        """Wrap ``argv`` so that nspawn starts in a cgroup of its own.

        Without a systemd PID 1 to ask for a scope, nspawn --keep-unit puts itself in
        ``<our cgroup>/supervisor`` and the container in ``<our cgroup>/payload``: the same two
        cgroups for every container started from here. The container's systemd sees ``payload`` as
        its root, so two containers at once share every unit's cgroup (``kimi-supervisor.service`` in
        one lists the other's processes, and stopping one kills the other's). A fresh cgroup per
        container, entered before nspawn runs, gives each its own ``supervisor``/``payload``. Under
        a systemd PID 1 the cgroups are systemd's to hand out (run the tier in a delegated scope).
        """
        if _pid1_is_systemd():
            return argv
        procs: list[str] = []
        for mount, own in _cgroup_hierarchies():
            path = os.path.join(mount, own.lstrip("/"), f"{DIR_PREFIX}{os.getpid()}-{self.name}")
            os.mkdir(path)
            self.cgroups.append(path)
            procs.append(os.path.join(path, "cgroup.procs"))
        # The shell moves itself, then execs (same PID): nspawn never runs in the shared cgroup.
        script = (
            'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'
        )
        return ["sh", "-c", script, "sh", str(len(procs)), *procs, *argv]

    def _prepare_rootfs(self) -> None:
        etc = self.merged / "etc/systemd/system"
        etc.mkdir(parents=True, exist_ok=True)
        (etc / HARNESS_TARGET).write_text(_HARNESS_TARGET_TEXT)
        for unit in self.mask:
            link = etc / unit
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to("/dev/null")

    def _boot_failure(self, what: str) -> NspawnError:
        rc = self._proc.poll() if self._proc else None
        state = f"nspawn exited with {rc}" if rc is not None else "nspawn still running"
        return NspawnError(
            f"container {self.name} {what} ({state}); console output:\n" + self.console_log(tail_bytes=8000)
        )

    def _find_pid1(self, deadline: float) -> int:
        assert self._proc is not None
        own_ns = _pid_ns("self")
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise self._boot_failure("exited during start")
            # sh and setpriv exec nspawn in place, so nspawn is self._proc.pid.
            # Breadth-first search below nspawn for a `systemd` process in a new
            # PID namespace (normally nspawn's direct child).
            todo = _children(self._proc.pid)
            while todo:
                pid = todo.pop(0)
                try:
                    if _comm(pid) == "systemd" and _pid_ns(pid) != own_ns:
                        return pid
                except OSError:
                    continue
                todo.extend(_children(pid))
            time.sleep(0.05)
        raise self._boot_failure("did not start systemd in time")

    def _wait_running(self, deadline: float) -> None:
        state = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise self._boot_failure("exited during boot")
            remaining = max(1.0, deadline - time.monotonic())
            try:
                r = self.run(["systemctl", "is-system-running"], check=False, timeout=min(10.0, remaining))
                state = r.stdout.strip()
            except subprocess.TimeoutExpired:
                state = "timeout"
            if state in ("running", "degraded"):
                self.boot_state = state
                return
            time.sleep(0.1)
        raise self._boot_failure(f"did not finish booting (last state {state!r})")

    def close(self) -> None:
        """Tear everything down; idempotent, never raises for cleanup problems
        unless mounts are left behind (then NspawnError)."""
        t0 = time.monotonic()
        try:
            self._stop_container()
        finally:
            leftover = self._cleanup_fs()
            self.teardown_seconds = time.monotonic() - t0
        if leftover:
            raise NspawnError(f"could not unmount {leftover}; left {self.root} in place")

    def _stop_container(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        pid1 = self._pid1
        # 1. Clean poweroff: SIGRTMIN+4 to systemd == `systemctl poweroff`.
        if pid1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid1, signal.SIGRTMIN + 4)
        else:
            # Not booted yet: SIGTERM makes nspawn halt the container.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.shutdown_timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        # 2. Force: SIGKILL the container's PID 1 (kills its whole PID
        # namespace), then nspawn's own process group (only what we started).
        if pid1 is not None and _comm(pid1) == "systemd":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid1, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _save_console_log(self) -> None:
        dest = os.environ.get(LOG_DIR_ENV)
        if dest and self._log_path is not None and self._log_path.exists():
            with contextlib.suppress(OSError):
                os.makedirs(dest, exist_ok=True)
                shutil.copyfile(self._log_path, Path(dest) / f"{self.name}.console.log")

    def _cleanup_fs(self) -> list[str]:
        self._save_console_log()
        leftover: list[str] = []
        if self.root is not None and self.root.exists():
            leftover = _umount_all(str(self.root))
            if not leftover:
                shutil.rmtree(self.root, ignore_errors=True)
        # nspawn creates this on the host and (with a non-tmpfs /run) refuses
        # to remove it itself.
        prop = Path("/run/systemd/nspawn/propagate") / self.name
        with contextlib.suppress(OSError):
            if prop.is_dir() and not _mounts_under(str(prop)):
                shutil.rmtree(prop)
        if not leftover:
            self.root = None
        self.cgroups = [cg for cg in self.cgroups if not _rmdir_tree(cg)]
        self._pid1 = None
        return leftover

    # -------------------------------------------------------------- commands
    def run(
        self,
        argv: Sequence[str],
        check: bool = True,
        timeout: float = 30.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (all namespaces, via nsenter).

        The host environment is NOT inherited; the command gets a clean
        environment (PATH=CONTAINER_PATH, LANG=C.UTF-8, no pager/colours) plus
        ``env``.  The process is not part of any unit; use ``systemd-run
        --wait --pipe`` if it must be.  stdout/stderr are captured as text.
        """
        base_env = {
            "PATH": CONTAINER_PATH,
            "LANG": "C.UTF-8",
            "HOME": "/root",
            "TERM": "dumb",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
            "SYSTEMD_LOG_COLOR": "0",
        }
        if env:
            base_env.update(env)
        cmd = [
            "nsenter",
            f"--target={self.pid1}",
            "--all",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in base_env.items()),
            *argv,
        ]
        # Own process group, so that on timeout we kill nsenter AND the command
        # it forked inside the container (which is not a child of the
        # container's systemd: left alive, it would stall poweroff ~10 s).
        with subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        ) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill_nsenter(proc)
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
            except BaseException:
                self._kill_nsenter(proc)
                raise
        r = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, list(argv), r.stdout, r.stderr)
        return r

    @staticmethod
    def _kill_nsenter(proc: subprocess.Popen[str]) -> None:
        """Kill a timed-out nsenter run without leaving a zombie behind.

        nsenter forks the command into the container's PID namespace.  Killing
        that child first lets nsenter reap it and exit; killing nsenter first
        would orphan it to the HOST's PID 1 (which may never reap it, and a
        zombie in the container's PID namespace stalls poweroff by ~10 s).
        Processes the command spawned itself get reparented to the container's
        systemd, which reaps them; the final killpg catches any stragglers.
        """
        if proc.returncode is not None:
            return
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        # Wait for nsenter to exit WITHOUT reaping it, so that its PID (= our
        # process group id) cannot be reused before the killpg below.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is not None:
                break
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", *args], check=check, timeout=timeout)

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def unit_property(self, unit: str, prop: str) -> str:
        """``systemctl show -p PROP --value UNIT`` (e.g. ActiveState, NRestarts)."""
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.rstrip("\n")

    def unit_main(self, unit: str) -> tuple[int, int]:
        """The unit's main process as (MainPID, ExecMainStartTimestampMonotonic), from one systemd read.

        A container's PID namespace is small: a restarted main can get the old main's PID back, so "restarted"
        and "the same process" compare both, never the PID alone.  (0, 0) while there is no main process.
        """
        out = self.systemctl("show", "-p", "MainPID", "-p", "ExecMainStartTimestampMonotonic", unit).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if props.get("MainPID", "0") == "0":
            return (0, 0)
        return int(props["MainPID"]), int(props["ExecMainStartTimestampMonotonic"])

    def unit_pids(self, unit: str) -> list[int]:
        """PIDs in the unit's cgroup (unified or the legacy name=systemd hierarchy, as the container
        sees them); [] once the cgroup is gone."""
        cg = self.unit_property(unit, "ControlGroup")
        if not cg:
            return []
        script = (
            'for b in /sys/fs/cgroup /sys/fs/cgroup/unified /sys/fs/cgroup/systemd; do f="$b$1/cgroup.procs"; '
            'if [ -f "$f" ]; then cat "$f"; exit 0; fi; done'
        )
        return [int(p) for p in self.run(["sh", "-c", script, "sh", cg]).stdout.split()]

    def journal(self, unit: str | None, *extra_args: str, timeout: float = 30.0) -> str:
        """``journalctl [-u UNIT] --no-pager EXTRA...`` output (current boot)."""
        argv = ["journalctl", "--no-pager", "-b"]
        if unit:
            argv += ["-u", unit]
        return self.run([*argv, *extra_args], timeout=timeout).stdout

    def journal_json(self, unit: str | None, *extra_args: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Journal entries as dicts (``journalctl -o json``).  Field values are
        strings, or lists of ints for non-UTF-8 / binary data."""
        out = self.journal(unit, "-o", "json", *extra_args, timeout=timeout)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Create/replace ``path`` inside the container (parents created).

        Written from inside the container's mount namespace, so this also works
        for paths on the container's tmpfs (/tmp, /run) and in rw binds.
        """
        if not path.startswith("/"):
            raise ValueError(f"path must be absolute: {path!r}")
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        self.run(["sh", "-c", script, "sh", path, f"{mode:o}"], input=text)

    def read_file(self, path: str) -> str:
        return self.run(["cat", "--", path]).stdout

    def install_unit(self, name: str, text: str, reload: bool = True) -> None:
        """Write /etc/systemd/system/NAME and (by default) daemon-reload."""
        self.write_file(f"/etc/systemd/system/{name}", text)
        if reload:
            self.daemon_reload()

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float,
        interval: float = 0.1,
        message: str = "condition",
    ) -> T:
        return wait_for(predicate, timeout, interval, message)

    def wait_for_property(self, unit: str, prop: str, value: str, timeout: float = 30.0) -> None:
        """Wait until ``unit_property(unit, prop) == value``."""
        last: list[str] = []

        def check() -> bool:
            last[:] = [self.unit_property(unit, prop)]
            return last[0] == value

        try:
            wait_for(check, timeout, message=f"{unit} {prop}={value}")
        except TimeoutError as e:
            raise TimeoutError(f"{e} (last value {last[0] if last else None!r})") from None
