"""Bytes the child's process tree read from storage: `/proc/PID/io` `read_bytes`, summed over the tree.

`read_bytes` counts what a process caused to be fetched from the storage layer (block I/O, and the NFS client's
reads), including pages it faulted in through an mmap, which is how vLLM's lazy safetensors loader reads.
Page-cache hits cost nothing there, so bytes read over a load say how much came from storage, not how much
vLLM touched (`rchar` would count read() calls only, never an mmap).  Reading another process's `io` needs
the same user or root (ptrace access mode): a member we may not read is counted, not guessed.

A member's counter goes with it when it exits, so the meter keeps each member's last value, by
(pid, start time): the total never falls when a short-lived helper ends.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable

import psutil

from kimi_supervisor.host.procident import ProcIdent

RATE_WINDOW_S = 10.0


def read_bytes(pid: int) -> int | None:
    """`read_bytes` of `pid` (psutil's io_counters, which reads `/proc/PID/io`), None when gone or not ours to
    read."""
    try:
        return int(psutil.Process(pid).io_counters().read_bytes)
    except (psutil.Error, OSError):
        return None


@dataclasses.dataclass(frozen=True)
class TreeReads:
    total_bytes: int  # summed over every member seen, alive or not
    members: int
    unreadable: int  # members alive now whose counter we may not read


class TreeReadMeter:
    """Sampled by the loop (cheap: one small read per member); never raises."""

    def __init__(self, read: Callable[[int], int | None] = read_bytes, window_s: float = RATE_WINDOW_S) -> None:
        self._read = read
        self._window = window_s
        self._last: dict[ProcIdent, int] = {}
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self.latest = TreeReads(0, 0, 0)

    def sample(self, now: float, members: Iterable[ProcIdent]) -> TreeReads:
        unreadable = 0
        for ident in members:
            value = self._read(ident.pid)
            if value is None:
                unreadable += ident not in self._last  # gone since the listing, or never readable
                continue
            self._last[ident] = max(value, self._last.get(ident, 0))
        total = sum(self._last.values())
        self.latest = TreeReads(total, len(self._last), unreadable)
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self._window:
            self._samples.popleft()
        return self.latest

    def rate(self) -> float | None:
        """Bytes per second over the last window; None before two samples."""
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else None


def format_rate(bytes_per_s: float) -> str:
    """`1.02 GB/s` (decimal units, as storage is sold and as the seeds' "1 GB/s" means)."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    if bytes_per_s >= 1e6:
        return f"{bytes_per_s / 1e6:.0f} MB/s"
    return f"{bytes_per_s / 1e3:.0f} kB/s"
