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

This module is the face (import everything from here) and the machine's lifecycle (boot, teardown); beside it
nspawn_host.py (host checks, mounts, cgroups, stale leftovers), nspawn_commands.py (commands run inside a booted
machine) and nspawn_wait.py (polling, systemd timespans, expect_no_restart).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

# The e2e tier imports this as tests.nspawn.nspawn: its siblings are imported by their own names either way.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from nspawn_commands import CONTAINER_PATH, MachineCommands  # noqa: E402
from nspawn_host import (  # noqa: E402
    DEFAULT_BASE_DIR,
    DIR_PREFIX,
    DISABLE_ENV,
    NspawnError,
    _cgroup_hierarchies,
    _children,
    _comm,
    _mounts_under,
    _pid1_is_systemd,
    _pid_ns,
    _rmdir_tree,
    _umount_all,
    available,
    cleanup_stale,
    needs_bind,
)
from nspawn_wait import expect_no_restart, timespan_s, wait_for  # noqa: E402

__all__ = [
    "CONTAINER_PATH",
    "DEFAULT_BASE_DIR",
    "DIR_PREFIX",
    "DISABLE_ENV",
    "NspawnError",
    "NspawnMachine",
    "available",
    "cleanup_stale",
    "expect_no_restart",
    "needs_bind",
    "timespan_s",
    "wait_for",
]


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


class NspawnMachine(MachineCommands):
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
        # How the container went: "poweroff" (systemd's own), "sigkill" (its PID 1 killed once shutdown_timeout
        # ran out), "sigkill-group" (nspawn's process group too), None (none was running).
        self.stopped_by: str | None = None

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
            self.stopped_by = "poweroff"
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
            self.stopped_by = "sigkill"
            return
        except subprocess.TimeoutExpired:
            pass
        self.stopped_by = "sigkill-group"
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
