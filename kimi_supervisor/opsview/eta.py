"""How long until ready: from the shard rate once shards load, before that from the last load.

A 540 GB model loads 119 shards in about nine minutes; the operator at 3 a.m.
wants "~3m10s left", not a percentage.  Three sources, best first:

* shards loading: the remaining shards at the rate observed since the first
  progress line, counted down between lines, plus what the last successful
  load needed after its weights (KV-cache profiling, CUDA graphs);
* weights loaded: what the last successful load needed after its weights;
* nothing loaded yet: the last successful load's duration.

No history and no shards yet: no estimate (None), rather than a made-up one.
"""

from __future__ import annotations

import dataclasses

from kimi_supervisor.child.readiness import Progress
from kimi_supervisor.clock import format_duration
from kimi_supervisor.opsview.history import RunRecord

# One shard tells little about the rate (the first includes opening the index): wait for two.
MIN_SHARDS_FOR_RATE = 2


@dataclasses.dataclass(frozen=True)
class Estimate:
    remaining_s: float
    basis: str  # "shard rate" | "last load"

    def text(self) -> str:
        return f"~{format_duration(self.remaining_s)} left"


class LoadEta:
    """Fed the tracker's progress (monotonic times); asked for an Estimate."""

    def __init__(self, last_load: RunRecord | None) -> None:
        self._last_load_s = last_load.load_s if last_load else None
        self._last_tail_s = last_load.post_weights_s if last_load else None
        self._first: tuple[float, int] | None = None  # (time, shards done) at the first progress seen
        self._latest: tuple[float, int, int] | None = None  # (time, done, total) at the latest change
        self.weights_done_at: float | None = None

    def observe(self, now: float, progress: Progress | None, weights_loaded: bool) -> None:
        if progress is not None and progress.total > 0:
            if self._first is None:
                self._first = (now, progress.done)
            if self._latest is None or self._latest[1:] != (progress.done, progress.total):
                self._latest = (now, progress.done, progress.total)
            if progress.done >= progress.total and self.weights_done_at is None:
                self.weights_done_at = now
        if weights_loaded and self.weights_done_at is None:
            self.weights_done_at = now

    def estimate(self, now: float, elapsed_s: float) -> Estimate | None:
        tail = self._last_tail_s or 0.0
        if self.weights_done_at is not None:
            if self._last_tail_s is None:
                return None
            return Estimate(max(0.0, self._last_tail_s - (now - self.weights_done_at)), "last load")
        if self._first is not None and self._latest is not None:
            t0, done0 = self._first
            at, done, total = self._latest
            if done - done0 >= MIN_SHARDS_FOR_RATE and at > t0:
                per_shard = (at - t0) / (done - done0)
                weights_left = max(0.0, (total - done) * per_shard - (now - at))
                return Estimate(weights_left + tail, "shard rate")
        if self._last_load_s is not None:
            return Estimate(max(0.0, self._last_load_s - elapsed_s), "last load")
        return None
