"""sd_notify: READY=1, STATUS=, EXTEND_TIMEOUT_USEC=, WATCHDOG=1, STOPPING=1.

Without NOTIFY_SOCKET (a terminal, the tests' plain runs) every call is a
no-op that never errors.  The watchdog is ours only when WATCHDOG_USEC is set
and WATCHDOG_PID, if set, names this process.

The sender is our own ~15 lines of systemd's documented protocol (sd_notify(3):
one AF_UNIX datagram of newline-separated KEY=value, UTF-8, to the path in
NOTIFY_SOCKET, '@' meaning the abstract namespace) instead of the `sdnotify`
package: 0.3.2 encodes as Latin-1 and swallows every error, so a STATUS with
"–", "✗" or U+FFFD silently lost the whole datagram, READY=1 included.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Protocol

from kimi_supervisor.logs.types import Logger
from kimi_supervisor.redact import redact_text

# A datagram systemd has not taken within this long is reported, not waited for (the loop must go on).
SEND_TIMEOUT_S = 1.0


class Notifier(Protocol):
    def send(self, **fields: str | int) -> None: ...


class NullNotifier:
    def send(self, **fields: str | int) -> None:
        return None


def encode(fields: Mapping[str, str | int]) -> bytes:
    """One datagram: systemd applies its fields together (STATUS with READY); newlines cannot inject fields."""
    return "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items()).encode("utf-8", "replace")


def socket_address(value: str) -> str | bytes:
    # '@name' is a Linux abstract-namespace socket: a leading NUL byte, no file.
    return b"\0" + value[1:].encode() if value.startswith("@") else value


class SdNotifier:
    """Sends each datagram at once; the first failure is logged, later ones counted until one succeeds."""

    def __init__(self, address: str, log: Logger | None = None) -> None:
        self.address = address
        self._log = log
        self.failures = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(SEND_TIMEOUT_S)

    def send(self, **fields: str | int) -> None:
        data = encode(fields)
        try:
            self._sock.sendto(data, socket_address(self.address))
        except OSError as exc:
            self.failures += 1
            if self.failures == 1 and self._log is not None:
                self._log.error(
                    "notify.failed", socket=self.address, error=f"{type(exc).__name__}: {exc}", fields=",".join(fields)
                )
            return
        if self.failures:
            if self._log is not None:
                self._log.warning("notify.recovered", socket=self.address, lost=self.failures)
            self.failures = 0

    def close(self) -> None:
        self._sock.close()


def notifier_from_env(environ: Mapping[str, str] | None = None, log: Logger | None = None) -> Notifier:
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    return SdNotifier(address, log) if address else NullNotifier()


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


PING_SLACK_S = 1.0  # a ping this late is withheld (the server is unhealthy), not merely late


class Watchdog:
    """WATCHDOG=1 at half of systemd's period, only while the latest /health pass is within one period and
    the caller calls the server healthy (no probe failing, no canary failing): a hung vLLM gets restarted."""

    def __init__(self, period_s: float | None, notifier: Notifier, last_ok: float) -> None:
        self.period_s = period_s or 0.0  # 0: the watchdog is not ours
        self._notifier = notifier
        self.last_ok = last_ok  # when the latest /health probe passed
        self._last_ping = 0.0

    def _may_ping(self, now: float, healthy: bool) -> bool:
        return self.period_s > 0 and healthy and now - self.last_ok <= self.period_s

    def wait_s(self, now: float, healthy: bool) -> float:
        """How long the loop may wait for anything else without a ping coming late."""
        if not self.period_s:
            return 1.0
        timeout = min(1.0, self.period_s / 4)
        if self._may_ping(now, healthy):
            # Wake when the next ping is due, not at the next output or probe: a ping was 0.2-0.3 s late.
            timeout = min(timeout, max(0.0, self._last_ping + self.period_s / 2 - now))
        return timeout

    def fires_in(self, now: float) -> float | None:
        """Seconds until systemd ends the run for want of a ping, once a ping is overdue (a healthy loop pings
        every half period, so a short WatchdogSec alone never looks like a coming kill); None otherwise."""
        if not self.period_s or not self._last_ping or now - self._last_ping <= self.period_s / 2 + PING_SLACK_S:
            return None
        return self._last_ping + self.period_s - now

    def pet(self, now: float, healthy: bool) -> None:
        if self._may_ping(now, healthy) and now - self._last_ping >= self.period_s / 2:
            self._notifier.send(WATCHDOG=1)
            self._last_ping = now


class RedactingNotifier:
    """sd_notify fields (STATUS= is world-readable in `systemctl status`) without secrets."""

    def __init__(self, inner: Notifier, secrets: tuple[str, ...]) -> None:
        self._inner = inner
        self._secrets = secrets

    def send(self, **fields: str | int) -> None:
        clean = {k: redact_text(v, self._secrets) if isinstance(v, str) else v for k, v in fields.items()}
        self._inner.send(**clean)
