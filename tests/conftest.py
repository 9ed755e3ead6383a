from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class ProcSpawner:
    """Starts real helper processes for a test and always kills exactly them afterwards."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def python(
        self, code: str, *, title: str | None = None, new_session: bool = True, extra_args: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        prologue = ""
        if title:
            # Like setproctitle: comm (15 chars) and the start of argv.
            prologue = (
                "import ctypes, ctypes.util\n"
                "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
                f"libc.prctl(15, {title.encode()!r}, 0, 0, 0)\n"
            )
        argv = [sys.executable, "-c", prologue + code, *(extra_args or [])]
        p = subprocess.Popen(argv, start_new_session=new_session, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(p)
        return p

    def sleeper(self, title: str | None = None, extra_args: list[str] | None = None) -> subprocess.Popen[bytes]:
        p = self.python(
            "import time, sys\nprint('up', flush=True)\ntime.sleep(600)", title=title, extra_args=extra_args
        )
        assert p.stdout is not None
        assert p.stdout.readline() == b"up\n"
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
            p.wait(timeout=10)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def spawner() -> Iterator[ProcSpawner]:
    s = ProcSpawner()
    try:
        yield s
    finally:
        s.cleanup()


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


# CI runs the property tests with a fixed seed: a red build must be reproducible, not a dice roll.
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    _hyp_settings.load_profile("ci")
