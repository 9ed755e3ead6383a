"""sd_notify: READY=1, STATUS=, EXTEND_TIMEOUT_USEC=, WATCHDOG=1, STOPPING=1.

Without NOTIFY_SOCKET (a terminal, the tests' plain runs) every call is a
no-op that never errors.  The watchdog is ours only when WATCHDOG_USEC is set
and WATCHDOG_PID, if set, names this process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

import sdnotify


class Notifier(Protocol):
    def send(self, **fields: str | int) -> None: ...


class NullNotifier:
    def send(self, **fields: str | int) -> None:
        return None


class SdNotifier:
    def __init__(self) -> None:
        self._n = sdnotify.SystemdNotifier()

    def send(self, **fields: str | int) -> None:
        # One datagram: systemd applies its fields together (STATUS with READY).
        text = "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        self._n.notify(text)


def notifier_from_env(environ: Mapping[str, str] | None = None) -> Notifier:
    env = os.environ if environ is None else environ
    return SdNotifier() if env.get("NOTIFY_SOCKET") else NullNotifier()


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """systemd's watchdog period in seconds, or None when the watchdog is not ours."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner and owner.isdigit() and int(owner) != (os.getpid() if pid is None else pid):
        return None
    return usec / 1e6
