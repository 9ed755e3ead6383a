"""A process the test makes unkillable: a cgroup-v1 freezer hierarchy mounted in the test's own directory.

A task frozen by the v1 freezer sits in uninterruptible sleep ("D (disk sleep)" in /proc/PID/status) and a
SIGKILL stays pending until it is thawed: from the outside, what an EngineCore stuck in the NVIDIA driver looks
like (vLLM #25127; docs/fault-matrix.md).  Only processes the test names are moved in, and `Freezer.close`
always thaws them, removes the cgroup and unmounts (the test's `finally`), so nothing stays frozen after a
failing test.

Mounting needs root and a kernel with the v1 freezer; where it is refused, `unavailable` says why (the test
skips; with CI=true it fails, as tests/promtool.py does for a missing promtool).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

STATE_TIMEOUT_S = 10.0  # FREEZING -> FROZEN takes microseconds; a bound, never an expected duration


class FreezerUnavailable(Exception):
    """The v1 freezer cannot be mounted here (not root, no such controller, a refused mount)."""


def _freezer_cgroup(pid: int) -> str:
    """The freezer cgroup `pid` is in, relative to the hierarchy's root ("/" when none is listed)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return path
    return "/"


class Freezer:
    """One freezer cgroup of our own under a mount point inside `base` (the test's tmp directory)."""

    def __init__(self, base: Path) -> None:
        self.mount = base / "freezer"
        self.mount.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "cgroup", "-o", "freezer", "kimi-test-freezer", str(self.mount)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if r.returncode != 0:
            self.mount.rmdir()
            raise FreezerUnavailable(f"mount -t cgroup -o freezer refused: {r.stderr.strip() or r.returncode}")
        # The hierarchy is shared with any other mount of it (the host's /sys/fs/cgroup/freezer): a unique name,
        # and only the PIDs we move in are ever touched.
        self.group = self.mount / f"kimi-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.group.mkdir()
        self.home: dict[int, str] = {}  # where each frozen PID came from, to put it back

    def freeze(self, pids: Iterable[int]) -> None:
        """Move `pids` (processes the test created) into our cgroup and freeze it; returns once it is FROZEN."""
        for pid in pids:
            self.home.setdefault(pid, _freezer_cgroup(pid))
            (self.group / "cgroup.procs").write_text(f"{pid}\n")
        self._set("FROZEN")

    def thaw(self) -> None:
        self._set("THAWED")

    def members(self) -> list[int]:
        text = (self.group / "cgroup.procs").read_text()
        return [int(line) for line in text.split()]

    def _set(self, state: str) -> None:
        (self.group / "freezer.state").write_text(state)
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while (self.group / "freezer.state").read_text().strip() != state:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.group}: freezer.state not {state} within {STATE_TIMEOUT_S}s")
            time.sleep(0.01)

    def close(self) -> None:
        """Thaw, put back whatever still lives, remove the cgroup, unmount: each step even when one before failed."""
        with contextlib.suppress(OSError, AssertionError):
            self.thaw()
        with contextlib.suppress(OSError):
            for pid in self.members():
                home = self.mount / self.home.get(pid, "/").lstrip("/")
                with contextlib.suppress(OSError):  # gone meanwhile, or its old cgroup went away: the root then
                    (home if home.is_dir() else self.mount).joinpath("cgroup.procs").write_text(f"{pid}\n")
        # A task that died after the thaw may still be counted until it is reaped: retry the rmdir briefly.
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while self.group.exists():
            try:
                self.group.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        subprocess.run(["umount", str(self.mount)], capture_output=True, timeout=30, check=False)
        with contextlib.suppress(OSError):
            self.mount.rmdir()


@contextlib.contextmanager
def freezer(base: Path) -> Iterator[Freezer]:
    """A Freezer for the block; thawed, removed and unmounted when it ends, however it ends."""
    f = Freezer(base)
    try:
        yield f
    finally:
        f.close()
