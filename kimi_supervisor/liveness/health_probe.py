"""Alive means answers: GET /health, probed from a thread so the loop never blocks.

Before the server binds, the port refuses connections: that is a normal
"not yet", reported as a failed probe without noise.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

from kimi_supervisor.liveness.http import HttpClient, request


@dataclasses.dataclass(frozen=True)
class HealthResult:
    ok: bool
    http_status: int | None  # None when no answer
    error: str | None
    at: float  # monotonic time the probe finished
    latency_s: float


def probe(url: str, timeout_s: float, http: HttpClient = request) -> HealthResult:
    """GET `url`; ok on HTTP 200.  `timeout_s` bounds the whole probe (httpget: connect to last byte)."""
    a = http("GET", url, timeout_s, max_body=MAX_HEALTH_BODY)
    if a.error is not None:
        return HealthResult(False, a.http_status, a.error, a.at, a.latency_s)
    return HealthResult(
        a.http_status == 200,
        a.http_status,
        None if a.http_status == 200 else f"HTTP {a.http_status}",
        a.at,
        a.latency_s,
    )


MAX_HEALTH_BODY = 64 * 1024  # vLLM's /health has an empty body


class HealthProber:
    """Probes `url` every `interval_s` in a daemon thread; results queue up for the loop."""

    def __init__(
        self, url: str, timeout_s: float, interval_s: float, wake: Callable[[], None], http: HttpClient = request
    ) -> None:
        self.url = url
        self._http = http
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
            self.results.put(probe(self.url, self._timeout, self._http))
            self._wake()
            self._changed.clear()
            bursting = time.monotonic() < self._burst_until
            self._changed.wait(self._burst_interval if bursting else self._interval)

    def new_results(self) -> list[HealthResult]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out
