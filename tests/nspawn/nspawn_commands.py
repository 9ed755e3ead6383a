"""Commands run in a booted machine (via nsenter): run, systemctl, unit properties and PIDs, the journal, files,
waits.  NspawnMachine (nspawn.py) gets them from MachineCommands; it supplies ``pid1``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from nspawn_host import _children
from nspawn_wait import wait_for

T = TypeVar("T")

#: PATH used for commands run inside the container (the host's PATH is not
#: inherited: pyenv shims and the like would leak in).
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class MachineCommands:
    """What a test runs inside a booted machine; ``pid1`` is the container's systemd as the host sees it."""

    @property
    def pid1(self) -> int:
        raise NotImplementedError

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
