"""Alive means answers: GET /health, probed from a thread so the loop never blocks.

Before the server binds, the port refuses connections: that is a normal
"not yet", reported as a failed probe without noise.
"""

from __future__ import annotations

import dataclasses
import queue
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class HealthResult:
    ok: bool
    status: int | None  # HTTP status, None when no answer
    error: str | None
    at: float  # monotonic time the probe finished
    latency_s: float


MAX_HEAD = 64 * 1024  # a status line and headers longer than this are not an answer


def probe(url: str, timeout_s: float) -> HealthResult:
    """GET `url`; ok when the status is 200.  `timeout_s` bounds the whole probe (connect to last header byte).

    A per-recv timeout is not enough: a server trickling one byte every 0.5 s never trips it and keeps the one
    prober thread stuck forever, so each recv gets only what is left of the deadline.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    start = time.monotonic()
    deadline = start + timeout_s
    sock: socket.socket | None = None
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        if parts.scheme == "https":
            sock.settimeout(_left(deadline))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nUser-Agent: kimi-supervisor\r\nConnection: close\r\n\r\n"
        )
        sock.settimeout(_left(deadline))
        sock.sendall(request.encode("ascii", "replace"))
        head = b""
        while b"\r\n\r\n" not in head:
            sock.settimeout(_left(deadline))
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("connection closed before the response headers ended")
            head += chunk
            if len(head) > MAX_HEAD:
                raise ValueError(f"response headers longer than {MAX_HEAD} bytes")
        status = _status(head)
        end = time.monotonic()
        return HealthResult(status == 200, status, None if status == 200 else f"HTTP {status}", end, end - start)
    except ConnectionRefusedError:
        end = time.monotonic()
        return HealthResult(False, None, "connection refused", end, end - start)
    except TimeoutError:
        end = time.monotonic()
        return HealthResult(False, None, f"no answer within {timeout_s:g}s", end, end - start)
    except (OSError, ValueError) as exc:
        end = time.monotonic()
        return HealthResult(False, None, f"{type(exc).__name__}: {exc}", end, end - start)
    finally:
        if sock is not None:
            sock.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _status(head: bytes) -> int:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/") or not code.isdigit():
        raise ValueError(f"not an HTTP status line: {line[:80]!r}")
    return int(code)


class HealthProber:
    """Probes `url` every `interval_s` in a daemon thread; results queue up for the loop."""

    def __init__(self, url: str, timeout_s: float, interval_s: float, wake: Callable[[], None]) -> None:
        self.url = url
        self._timeout = timeout_s
        self._interval = interval_s
        self._wake = wake
        self.results: queue.SimpleQueue[HealthResult] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._burst_interval = interval_s
        self._burst_until = 0.0
        self._thread = threading.Thread(target=self._run, name="health-prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_interval(self, interval_s: float) -> None:
        self._interval = interval_s
        self._burst_until = 0.0
        self._changed.set()

    def burst(self, interval_s: float, for_s: float) -> None:
        """Probe at once, then every `interval_s` for `for_s` seconds, then at the set interval again."""
        self._burst_interval = interval_s
        self._burst_until = time.monotonic() + for_s
        self._changed.set()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.put(probe(self.url, self._timeout))
            self._wake()
            self._changed.clear()
            bursting = time.monotonic() < self._burst_until
            self._changed.wait(self._burst_interval if bursting else self._interval)

    def drain(self) -> list[HealthResult]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out
