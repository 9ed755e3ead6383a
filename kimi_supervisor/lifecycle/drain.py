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

SIGTERM goes out within SAMPLE_AT_SIGTERM_S of the stop request: the one
/metrics read before it has that overall deadline (httpget).  While it drains,
/metrics (running + waiting) is read from a thread, so the stop loop keeps
forwarding vLLM's output and acting on a second stop signal, never waiting on
HTTP.

Its I/O comes in: the HTTP client, the clock, the sampler's schedule (a thread;
testkit's lifecycle world runs it on the fake clock) and the child it signals,
so the whole drain runs in fake time against a scripted /metrics.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kimi_supervisor.child.process import Child
from kimi_supervisor.liveness.http import HttpClient, request
from kimi_supervisor.liveness.vllm_metrics import MetricsError, fetch_metrics
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd.notify import Notifier

# The one read before SIGTERM: SIGTERM follows the stop request within this (plus a process-tree scan), never
# later, whatever /metrics does (a status line trickled one byte per 0.9 s held the old read forever).  On a
# busy 2-core host a real read took > 0.5 s at times (bench/results/vllm_drain_cpu.md); then the count comes
# from the sampler's first reading after SIGTERM: a draining vLLM keeps serving /metrics and takes no new
# request, so that reading counts the requests it is draining.
SAMPLE_AT_SIGTERM_S = 0.25
POLL_S = 1.0
FETCH_TIMEOUT_S = 2.0
SAY_EVERY_S = 1.0
LOG_EVERY_S = 5.0


def metrics_url(health_url: str) -> str:
    base = health_url[: -len("/health")] if health_url.endswith("/health") else health_url.rstrip("/")
    return f"{base}/metrics"


def _requests(n: float) -> str:
    count = int(n)
    return f"{count} request{'s' if count != 1 else ''}"


# One reading of /metrics while draining: (monotonic time, in flight or None, error or "").
Reading = tuple[float, float | None, str]


class Sampler(Protocol):
    """Takes a reading every POLL_S from `start` until `stop`; `latest` is the last one, replaced whole."""

    latest: Reading | None

    def start(self) -> None: ...

    def stop(self) -> None: ...


SamplerFactory = Callable[[Callable[[], Reading]], Sampler]


class MetricsSampler(threading.Thread):
    """The real Sampler: a daemon thread, so the stop loop never waits on HTTP."""

    def __init__(self, read: Callable[[], Reading]) -> None:
        super().__init__(name="kimi-drain-metrics", daemon=True)
        self._read = read
        self._stop_event = threading.Event()
        self.latest: Reading | None = None  # one tuple, replaced whole (atomic under the GIL)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.latest = self._read()
            self._stop_event.wait(POLL_S)

    def stop(self) -> None:
        self._stop_event.set()


class Drain:
    """One stop of a serving vLLM: the first SIGTERM, progress in STATUS= and the log, one final record."""

    def __init__(
        self,
        health_url: str,
        timeout_s: int,
        notifier: Notifier,
        log: Logger,
        *,
        http: HttpClient = request,
        clock: Callable[[], float] = time.monotonic,
        sampler: SamplerFactory = MetricsSampler,
    ) -> None:
        self.url = metrics_url(health_url)
        self.timeout_s = timeout_s
        self._notifier = notifier
        self._log = log
        self._http = http
        self._clock = clock
        self.in_flight_at_sigterm: float | None = None
        self.in_flight_source: str | None = None  # "read at SIGTERM", "first drain sample" or "liveness sample"
        # The liveness thread's latest (monotonic time, in flight) from before the stop: the count when neither
        # the read at SIGTERM nor a drain sample has one (no drain: no sampler runs).
        self.liveness_sample: tuple[float, float] | None = None
        self.sigterm_after_s: float | None = None  # from the stop's start to the signal
        self._sampler = sampler(self._read)
        self._t0 = 0.0
        self._drained_at: float | None = None
        self._main_exited_at: float | None = None  # vLLM's main exited by itself (before any SIGKILL)
        self._zero_at: float | None = None  # a drain sample read 0 in flight (before the main exited)
        # The main's exit was a signal the supervisor never sent (the OOM killer, an operator's kill -9) before
        # any sample read 0: whatever was in flight was cut, not drained.
        self._died_of: str | None = None
        self._child: Child | None = None
        self._killed_at: float | None = None
        self._in_flight_at_kill: float | None = None
        self._last_said = 0.0
        self._last_log = 0.0

    def sigterm(self, child: Child) -> int:
        """Count what is in flight (at most SAMPLE_AT_SIGTERM_S), then SIGTERM vLLM's main process alone."""
        start = self._clock()
        try:
            self.in_flight_at_sigterm = fetch_metrics(self.url, SAMPLE_AT_SIGTERM_S, self._http).in_flight
            if self.in_flight_at_sigterm is not None:
                self.in_flight_source = "read at SIGTERM"
        except MetricsError as exc:
            # A draining vLLM keeps serving /metrics and rejects new requests: the sampler's first count stands in.
            self._log.warning("stop.metrics_unavailable", url=self.url, error=str(exc))
        if self.in_flight_at_sigterm is None and not self.timeout_s:
            self._from_liveness(start)
        self._child = child
        child.refresh_members()  # remembered, so workers that outlive the main are still found
        child.signal_main(signal.SIGTERM)
        self._t0 = self._clock()
        self.sigterm_after_s = round(self._t0 - start, 3)
        if self.timeout_s:
            # The first STATUS= says what was known at SIGTERM, before the sampler's first reading can race it.
            self._say(self._t0, force=True)
            self._sampler.start()
        return 1

    def _read(self) -> Reading:
        try:
            return (self._clock(), fetch_metrics(self.url, FETCH_TIMEOUT_S, self._http).in_flight, "")
        except MetricsError as exc:
            return (self._clock(), None, str(exc))

    def _from_liveness(self, now: float) -> None:
        if self.liveness_sample is not None:
            at, count = self.liveness_sample
            self.in_flight_at_sigterm = count
            self.in_flight_source = f"liveness sample {max(0.0, now - at):.1f}s old"

    def tick(self, child: Child) -> None:
        """Called from the stop loop: never blocks."""
        now = self._clock()
        sample = self._sampler.latest
        if self.in_flight_at_sigterm is None and sample is not None and sample[1] is not None:
            self.in_flight_at_sigterm = sample[1]
            self.in_flight_source = "first drain sample"
        if self._drained_at is None and self._killed_at is None and sample is not None and sample[1] == 0:
            self._drained_at = self._zero_at = sample[0]
        if self._main_exited_at is None and self._killed_at is None and child.poll() is not None:
            self._main_exited_at = now
            self._died_of = _foreign_signal(child.returncode) if self._zero_at is None else None
            if self._drained_at is None:
                self._drained_at = now
            # vLLM's main stops its own engine and workers; anything still here gets SIGTERM now.
            child.signal_tree(signal.SIGTERM)
            self._log.info("stop.main_exited", after_s=round(now - self._t0, 2), exit_status=child.returncode)
        if self.timeout_s:
            self._say(now)

    def sigkill(self, child: Child) -> None:
        """The stop loop is about to SIGKILL the tree: say whether vLLM's main was still draining, and what."""
        if self._main_exited_at is None and child.poll() is not None:
            self.tick(child)  # it exited by itself since the last look
        now = self._clock()
        self._killed_at = now
        if self._main_exited_at is not None:
            return  # the main exited by itself: only stragglers are killed, the drain's outcome stands
        sample = self._sampler.latest
        if sample is not None and sample[1] is not None:
            self._in_flight_at_kill = sample[1]
        elif self._drained_at is None:
            self._in_flight_at_kill = self.in_flight_at_sigterm
        else:
            self._in_flight_at_kill = 0.0
        what = "count unknown" if self._in_flight_at_kill is None else f"{_requests(self._in_flight_at_kill)} in flight"
        self._notifier.send(STATUS=f"stopping: SIGKILL to vLLM after {now - self._t0:.0f}s of draining ({what})")

    @property
    def outcome(self) -> str:
        """drained: vLLM's main exited by itself within its deadline; cut: past it (vLLM cut requests); aborted:
        no drain (vLLM aborted every request at SIGTERM); nothing_in_flight: no drain, and nothing was in flight at
        SIGTERM to abort (was `aborted`, which read as lost requests); killed: the main was still there at the
        SIGKILL; died: a signal the supervisor never sent ended the main before the drain was seen to reach 0."""
        if self._killed_at is not None and self._main_exited_at is None:
            return "killed"
        if self._died_of is not None:
            return "died"
        if self.timeout_s == 0:
            return "nothing_in_flight" if self.in_flight_at_sigterm == 0 else "aborted"
        return "drained" if self._drain_s() <= self.timeout_s else "cut"

    def _drain_s(self) -> float:
        if self._killed_at is not None and self._main_exited_at is None:
            return self._killed_at - self._t0
        # The main exited by itself: seen by tick(), or only as the whole tree gone at the stop loop's last look.
        ended = self._drained_at if self._drained_at is not None else self._main_exited_at
        return (ended if ended is not None else self._clock()) - self._t0

    def headline(self, now: float) -> str:
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
        if self._killed_at is not None:
            return  # the SIGKILL's STATUS= stands
        if not force and now - self._last_said < SAY_EVERY_S:
            return
        self._last_said = now
        text = self.headline(now)
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
        """The one record: in flight at SIGTERM, how long the drain took, how it ended."""
        self._sampler.stop()
        now = self._clock()
        if self.in_flight_at_sigterm is None:
            self._from_liveness(self._t0)
        if self._main_exited_at is None and self._killed_at is None and self._zero_at is None and self._child:
            # The whole tree went between two looks, so tick() never saw the main's exit: its status still says how.
            self._died_of = _foreign_signal(self._child.poll())
        outcome = self.outcome
        drain_s = 0.0 if outcome in ("aborted", "nothing_in_flight") else self._drain_s()
        self._log.info(
            "stop.drain",
            in_flight_at_sigterm=self.in_flight_at_sigterm,
            in_flight_source=self.in_flight_source,
            sigterm_after_s=self.sigterm_after_s,
            drain_s=round(drain_s, 2),
            drain_timeout_s=self.timeout_s,
            outcome=outcome,
            # killed: what /metrics last said was in flight when the SIGKILL went out (None: unknown).
            in_flight_at_sigkill=self._in_flight_at_kill if outcome == "killed" else None,
            # died: the signal that ended vLLM's main, which the supervisor did not send.
            main_died_of=self._died_of,
            stop_s=round(now - self._t0, 2),
            tree_gone=tree_gone,
        )


def _foreign_signal(returncode: int | None) -> str | None:
    """The name of the signal that ended the main when the supervisor did not send it: it sends SIGTERM to a
    draining main, and its own SIGKILL is recorded as `killed` before this is ever asked."""
    if returncode is None or returncode >= 0 or -returncode == signal.SIGTERM:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def stopped_headline(tree_gone: bool, gpus_free: bool | None, drain_outcome: str | None = None) -> str:
    """The last STATUS= of a stop: what an operator needs before starting again."""
    tree = "tree gone" if tree_gone else "processes left behind (see stop.survivors)"
    if drain_outcome == "killed":
        tree += " (drain cut: vLLM was SIGKILLed, see stop.drain)"
    elif drain_outcome == "died":
        tree += " (drain cut: vLLM's main was killed by a signal the supervisor did not send, see stop.drain)"
    if gpus_free is None:
        return f"stopping: {tree}"
    return f"stopping: {tree}, {'GPUs free' if gpus_free else 'GPUs still busy'}"
