"""The child: spawn `vllm serve`, read its pipes without ever blocking it, end its tree.

The child gets its own session and process group, so one killpg reaches every
worker that stayed in it.  Workers that left (setsid) or were orphaned are
still found: the supervisor is a child subreaper, so orphans come back to it,
and members are listed (descendants and same-session processes, remembered by
(pid, create_time)) before every signal, as circus does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import fcntl
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import psutil

from kimi_supervisor.child.cachedirs import CacheUnusable, cache_environment, cache_home, ensure_home
from kimi_supervisor.child.spawnplan import (
    Identity,
    Unresolvable,
    credential_environment,
    identity_environment,
    resolve_executable,
    resolve_identity,
    switch_to,
)
from kimi_supervisor.config.model import SpawnSpec
from kimi_supervisor.exitcodes import SpawnError
from kimi_supervisor.host.procident import ProcIdent, exited, group_signal, identify, same_start, send_signal
from kimi_supervisor.redact import REDACTED_BYTES, secret_bytes

__all__ = ["ChildProcess", "LineSplitter", "SpawnSpec", "become_subreaper", "child_environment"]

PR_SET_CHILD_SUBREAPER = 36
F_SETPIPE_SZ = 1031
# Removed from the child's environment: they belong to the supervisor (vLLM
# may learn to notify systemd itself; it must not talk over us).
PRIVATE_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "JOURNAL_STREAM",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    # The child gets the credentials child.credentials maps to its variables, not the directory of them all.
    "CREDENTIALS_DIRECTORY",
)


def become_subreaper() -> bool:
    """Orphaned descendants get reparented to us instead of PID 1, so we can reap and kill them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except OSError:
        return False


def child_environment(spec: SpawnSpec, parent: Mapping[str, str], identity: Identity | None = None) -> dict[str, str]:
    base = dict(parent) if spec.inherit_environment else {k: parent[k] for k in ("PATH", "LANG", "HOME") if k in parent}
    base.update(identity_environment(identity))  # root's HOME=/root must not follow the child to its user
    base.update(spec.env)
    for key in PRIVATE_ENV:
        base.pop(key, None)
    # Python children block-buffer a pipe; their lines must arrive as written.
    base.setdefault("PYTHONUNBUFFERED", "1")
    return base


@dataclasses.dataclass(frozen=True)
class PreparedSpawn:
    """Everything a spawn needs that depends on the host: resolved before the preflight acts."""

    identity: Identity | None
    executable: str
    env: Mapping[str, str]
    cache_note: str | None = None  # why the caches keep vLLM's defaults (cachedirs.py), for the log


def prepare_spawn(spec: SpawnSpec, parent_env: Mapping[str, str], *, create: bool = True) -> PreparedSpawn:
    """Resolve user, groups, environment and the executable; raises Unresolvable naming the key.

    Also makes the child's cache home (cachedirs.py): a directory of its own that no start can be hurt by;
    CacheUntrusted (exit 78) when one is there that is not.  `create` False (a dry run): makes nothing and
    reads no credential."""
    identity = resolve_identity(spec.user, spec.group)
    env = child_environment(spec, parent_env, identity)
    if create:  # a dry run reads no secret: its report names the credential each variable would come from
        env.update(credential_environment(spec.credentials, parent_env))
    note = None
    home = cache_home(spec.cache_directory, identity)
    if home is not None and spec.cache_directory is not None:
        try:
            ensure_home(spec.cache_directory, home, identity, create=create)
            env.update(cache_environment(home, env))
        except CacheUnusable as exc:
            note = str(exc)
    executable = resolve_executable(spec.argv[0], env, spec.working_directory, identity)
    return PreparedSpawn(identity, executable, env, note)


class LineSplitter:
    """Bytes to lines, on \\n and \\r (tqdm redraws with \\r), each at most `max_line` bytes.

    A longer line is cut: its head is kept with a marker, the rest dropped up
    to the next newline, so a 1 MB line without newline costs max_line of memory.
    Known secrets are replaced (longest first) *before* the cut: the head is kept
    with a margin of the longest secret, so no part of a token survives at the cut.
    """

    def __init__(self, max_line: int = 16 * 1024, secrets: Iterable[str] = ()) -> None:
        self._max = max_line
        self._secrets = secret_bytes(secrets)
        self._keep = max_line + max((len(x) for x in self._secrets), default=0)
        self._buf = b""
        self._skipping = 0

    def feed(self, data: bytes) -> list[str]:
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = data.split(b"\n")
        out: list[str] = []
        first = parts[0]
        if len(parts) == 1:
            self._append(first, out)
            return out
        self._append(first, out)
        self._end_line(out)
        for part in parts[1:-1]:
            if len(part) > self._keep:
                out.append(self._line(part[: self._keep], len(part)))
            elif part:
                out.append(self._line(part, len(part)))
        self._append(parts[-1], out)
        return out

    def _append(self, data: bytes, out: list[str]) -> None:
        if self._skipping:
            self._skipping += len(data)
            return
        self._buf += data
        if len(self._buf) > self._keep:
            self._skipping = len(self._buf)
            out.append(self._line(self._buf[: self._keep], None))
            self._buf = b""

    def _end_line(self, out: list[str]) -> None:
        if self._skipping:
            self._skipping = 0
        elif self._buf:
            out.append(self._line(self._buf, len(self._buf)))
        self._buf = b""

    def _line(self, data: bytes, total: int | None) -> str:
        """`data`: the line's head (up to max + margin); `total`: its full length, None when unknown."""
        for secret in self._secrets:
            if secret in data:
                data = data.replace(secret, REDACTED_BYTES)
        if total is not None and total <= self._keep and len(data) <= self._max:
            return data.decode("utf-8", "replace")  # the whole line, and it fits
        size = f"{total} bytes" if total is not None else f"more than {self._max} bytes"
        return data[: self._max].decode("utf-8", "replace") + f" [line cut: {size}]"

    def close(self) -> list[str]:
        out: list[str] = []
        self._end_line(out)
        return out


def read_pipe(fd: int) -> bytes | None:
    """What a non-blocking pipe holds now; b'' when nothing; None at end of file (or a broken pipe)."""
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""
    except OSError:
        return None
    return data if data else None


class Child(Protocol):
    """The spawned vLLM and its process tree (child.ChildProcess)."""

    pid: int
    returncode: int | None
    exit_fd: int | None  # readable once the spawned process exited (a pidfd): the loop's exit wake-up
    exit_fd_error: str | None  # why there is no exit_fd (the loop then polls)
    streams: dict[str, int]

    def read(self, fd: int) -> bytes | None: ...

    def poll(self) -> int | None: ...

    def refresh_members(self) -> Any: ...

    def alive_members(self) -> list[Any]: ...  # psutil.Process in production: the loop reads .pid, .create_time()

    def signal_tree(self, sig: signal.Signals) -> int: ...

    def signal_main(self, sig: signal.Signals) -> None: ...  # the spawned process alone (a draining vLLM)

    def reap(self) -> None: ...


def _pidfd(pid: int) -> tuple[int | None, str | None]:
    """A pidfd for our own unreaped child (its PID cannot be recycled yet), or why there is none."""
    try:
        return os.pidfd_open(pid), None
    except AttributeError:
        return None, "os.pidfd_open is missing (Python built without it)"
    except OSError as exc:  # ENOSYS: Linux < 5.3; EPERM: a seccomp sandbox refusing it
        return None, f"pidfd_open: {exc.strerror or exc}"


def _our_helper(pid: int) -> bool:
    """A process the supervisor ran itself (py-spy for an incident, systemctl), never a member of vLLM's tree.

    The session tells them apart: vLLM's main starts a session of its own (start_new_session), and no process
    can join an existing session, so nothing of vLLM's tree is ever in ours, while every helper we run without
    a new session is.  Counted as the tree, a py-spy stuck in D state was SIGKILLed with it, outlived it, and
    turned a restartable exit into 22 (issue 49)."""
    try:
        return os.getsid(pid) == os.getsid(0)
    except OSError:  # gone: nothing to count either way
        return False


class ChildProcess:
    """A spawned child and its process tree."""

    def __init__(self, popen: subprocess.Popen[bytes], owns_all_children: bool = False) -> None:
        self._popen = popen
        # True in the supervisor process, where every child of ours belongs to
        # this tree; False in tests, where the test runner has other children.
        self._owns_all = owns_all_children
        self.pid = popen.pid
        self.sid = popen.pid  # start_new_session: session id == process group id == pid
        self.known: dict[int, float] = {}
        self.returncode: int | None = None
        self.exit_fd, self.exit_fd_error = _pidfd(popen.pid)
        assert popen.stdout is not None and popen.stderr is not None
        self.streams = {"stdout": popen.stdout.fileno(), "stderr": popen.stderr.fileno()}
        for fd in self.streams.values():
            os.set_blocking(fd, False)
            # A larger pipe absorbs bursts while the loop is busy elsewhere.
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
        self.refresh_members()

    @classmethod
    def spawn(
        cls,
        spec: SpawnSpec,
        parent_env: Mapping[str, str] | None = None,
        owns_all_children: bool = False,
        prepared: PreparedSpawn | None = None,
    ) -> ChildProcess:
        if prepared is None:
            try:
                prepared = prepare_spawn(spec, os.environ if parent_env is None else parent_env)
            except Unresolvable as exc:
                raise SpawnError(f"cannot start child: child.{exc.key}: {exc.message}") from None
        ident = switch_to(prepared.identity)
        try:
            # Popen drops privileges between fork and exec in C (setgroups, setregid, setreuid): no preexec_fn.
            popen = subprocess.Popen(
                list(spec.argv),
                executable=prepared.executable,
                env=dict(prepared.env),
                cwd=spec.working_directory,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                user=None if ident is None else ident.uid,
                group=None if ident is None else ident.gid,
                extra_groups=None if ident is None else list(ident.groups),
            )
        except FileNotFoundError as exc:
            missing = spec.working_directory if exc.filename == spec.working_directory else spec.argv[0]
            raise SpawnError(f"cannot start child: {missing}: no such file or directory") from None
        except PermissionError as exc:
            raise SpawnError(f"cannot start child: {exc.filename or spec.argv[0]}: permission denied") from None
        except (KeyError, ValueError) as exc:
            raise SpawnError(f"cannot start child as user {spec.user!r}: {exc}") from None
        except OSError as exc:
            raise SpawnError(f"cannot start child {spec.argv[0]}: {exc.strerror}") from None
        return cls(popen, owns_all_children)

    def read(self, fd: int) -> bytes | None:
        return read_pipe(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._popen.poll()
        return self.returncode

    # -- the tree -------------------------------------------------------------

    def refresh_members(self) -> list[psutil.Process]:
        """Every process of the tree now: descendants, same session, and remembered ones."""
        return self._members(scan_sessions=True)

    def _members(self, scan_sessions: bool) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        try:
            # Only while the main is unreaped: after, its PID may name a newcomer (and its children), and the
            # main's orphans are found below, as our children or by the session id.
            if self._popen.returncode is None:
                root = psutil.Process(self.pid)
                found[root.pid] = root
                for p in root.children(recursive=True):
                    found[p.pid] = p
        except psutil.NoSuchProcess:
            pass
        if self._owns_all:
            # Our other children are the tree's orphans (we are a subreaper), except our own helpers.
            for p in psutil.Process().children(recursive=True):
                if not _our_helper(p.pid):
                    found.setdefault(p.pid, p)
        if scan_sessions and self._session_id_is_ours():
            # Members that called setsid() or lost their parent: a walk over every process.
            for p in psutil.process_iter():
                if p.pid not in found:
                    try:
                        if os.getsid(p.pid) == self.sid:
                            found[p.pid] = p
                    except OSError:
                        continue
        for pid, created in list(self.known.items()):
            if pid not in found:
                try:
                    p = psutil.Process(pid)
                    if same_start(ProcIdent(pid, p.create_time()), ProcIdent(pid, created)):
                        found[pid] = p
                    else:
                        del self.known[pid]  # that member is gone; a stranger holds its PID now
                except psutil.NoSuchProcess:
                    del self.known[pid]
        live = []
        for p in found.values():
            try:
                if exited(p.pid):
                    continue
                # Assigned, not kept: a member found now on a PID an earlier member had is a new process,
                # and signal_tree signals the identity remembered here (a PID namespace reuses PIDs soon).
                self.known[p.pid] = p.create_time()
                live.append(p)
            except psutil.NoSuchProcess:
                continue
        return live

    def _session_id_is_ours(self) -> bool:
        """The session id is the main's PID.  Until the main is reaped, that PID (so the id) cannot be handed out
        again; after, a newcomer holding the PID (a small PID namespace) may lead a session of the same id, the
        stranger's: setsid() is what systemd does for every service.  While members of ours remain in the session
        the kernel keeps the number from being reused, so a process holding it means they are gone."""
        return self._popen.returncode is None or identify(self.sid) is None

    def signal_tree(self, sig: signal.Signals) -> int:
        """Signal the process group and every listed member; returns how many were signalled.

        Members are signalled through pidfds (a recycled PID is never hit); the
        group only while our child, its leader, is unreaped (see group_signal).
        """
        members = self.refresh_members()
        group_signal(self._popen.returncode is None, self.sid, sig)
        count = 0
        for p in members:
            created = self.known.get(p.pid)
            if created is not None and send_signal(ProcIdent(p.pid, created), sig):
                count += 1
        return count

    def signal_main(self, sig: signal.Signals) -> None:
        """Signal the spawned process alone: our own unreaped child, so its PID cannot have been recycled."""
        os.kill(self.pid, sig)

    def reap(self) -> None:
        """Collect zombie children: the main child via Popen, orphans via waitpid."""
        if self.poll() is not None and self.exit_fd is not None:
            fd, self.exit_fd = self.exit_fd, None
            os.close(fd)  # its process is reaped: nothing is left to watch
        for p in psutil.Process().children():
            if p.pid == self.pid:
                continue
            try:
                # A helper's zombie is its Popen's to reap: taken here, its wait() would read ECHILD as exit 0.
                ours = (
                    (self._owns_all and not _our_helper(p.pid)) or p.pid in self.known or os.getsid(p.pid) == self.sid
                )
                if ours and p.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(p.pid, os.WNOHANG)
            except (psutil.NoSuchProcess, ChildProcessError, OSError):
                continue

    def alive_members(self) -> list[psutil.Process]:
        """Members still running, polled cheaply: the remembered ones plus the tree under the child.

        The full scan of every process (for members that left the tree) runs in signal_tree, before
        each signal; polling between signals only has to watch what was found then.
        """
        self.reap()
        return self._members(scan_sessions=False)


class ProcessSpawner:
    """The real spawn: resolved before the preflight acts; every child of this process belongs to the tree."""

    def prepare(self, spec: SpawnSpec, parent_env: Mapping[str, str]) -> PreparedSpawn:
        return prepare_spawn(spec, parent_env)

    def spawn(self, spec: SpawnSpec, parent_env: Mapping[str, str], prepared: PreparedSpawn | None) -> ChildProcess:
        return ChildProcess.spawn(spec, parent_env, owns_all_children=True, prepared=prepared)
