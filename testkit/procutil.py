"""Process helpers shared by the tests, the fakes and the benches (stdlib only: the fake vLLM and the
device-side bench scripts import it too)."""

from __future__ import annotations

import contextlib
import ctypes
import random
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


EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_claimed: list[socket.socket] = []  # the claims this process holds, oldest first
_KEEP = 512  # claims kept at once; an older one is a port whose test has long ended


def port_window(ephemeral: tuple[int, int] | None = None) -> range:
    """The ports a test may pick: outside the kernel's ephemeral range, from which every `connect()` on this host
    takes its source port.  A port picked inside it can be taken by any connection (a health probe of a test
    running beside) between the pick and the child's bind, and the supervisor's port check then fails the start."""
    if ephemeral is None:
        try:
            with open(EPHEMERAL) as fh:
                low, high = (int(f) for f in fh.read().split())
        except (OSError, ValueError):
            low, high = 32768, 60999  # the kernel's default
    else:
        low, high = ephemeral
    if low - 1024 >= 4096:
        return range(max(1024, low - 16384), low)
    return range(high + 1, 65536)


def claim_port(port: int) -> bool:
    """Hold PORT for this process's life if no other test process holds it and it is bindable now.  The claim is
    an abstract Unix socket named for the port: one namespace for every test process on the host (xdist workers,
    another worktree's run, a bench), any user, no file left behind, gone when the process ends."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0kimi-test-port-{port}")
    except OSError:
        claim.close()
        return False
    if not _bindable(port):
        claim.close()
        return False
    _claimed.append(claim)
    if len(_claimed) > _KEEP:
        _claimed.pop(0).close()
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the supervisor's port check binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port no other test process holds, bindable now, outside the ephemeral range (port_window)."""
    window = port_window()
    start = random.randrange(len(window))
    for i in range(len(window)):
        port = window[(start + i) % len(window)]
        if claim_port(port):
            return port
    raise OSError(f"no free test port in {window.start}-{window.stop - 1}")


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
