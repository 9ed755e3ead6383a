"""Alive means answers: GET /health, probed from a thread so the loop never blocks.

Before the server binds, the port refuses connections: that is a normal
"not yet", reported as a failed probe without noise.
"""

from __future__ import annotations

import dataclasses
import http.client
import queue
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


def probe(url: str, timeout_s: float) -> HealthResult:
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    start = time.monotonic()
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/", headers={"User-Agent": "kimi-supervisor"})
        resp = conn.getresponse()
        resp.read(4096)
        end = time.monotonic()
        return HealthResult(
            resp.status == 200, resp.status, None if resp.status == 200 else f"HTTP {resp.status}", end, end - start
        )
    except ConnectionRefusedError:
        end = time.monotonic()
        return HealthResult(False, None, "connection refused", end, end - start)
    except TimeoutError:
        end = time.monotonic()
        return HealthResult(False, None, f"no answer within {timeout_s:g}s", end, end - start)
    except (OSError, http.client.HTTPException) as exc:
        end = time.monotonic()
        return HealthResult(False, None, f"{type(exc).__name__}: {exc}", end, end - start)
    finally:
        conn.close()


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
