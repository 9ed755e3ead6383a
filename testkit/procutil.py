"""Process helpers shared by the tests, the fakes and the benches (stdlib only: the fake vLLM and the
device-side bench scripts import it too)."""

from __future__ import annotations

import contextlib
import ctypes
import socket

PR_SET_NAME = 15


def set_comm(name: str) -> None:
    """prctl(PR_SET_NAME): the kernel keeps 15 bytes of it (/proc/PID/comm, psutil's name from stat)."""
    raw = name.encode()[:15]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if int(libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)) == 0:
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(OSError), open("/proc/self/comm", "wb") as fh:
        fh.write(raw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stat(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the comm ([state, ppid, pgrp, ...]); None once the PID is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()


def proc_state(pid: int) -> str:
    """The /proc state letter, or '-' when the PID is gone (reaped)."""
    fields = proc_stat(pid)
    return fields[0].decode() if fields else "-"


def proc_ppid(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[1]) if fields else None


def live(pid: int) -> bool:
    return proc_state(pid) not in ("-", "Z", "X")
