"""Our threads' deaths, noticed: a check whose thread died must end the run, not go quiet.

The canary, the health prober, the metrics sampler and the GPU event waiter each run in a daemon thread
that only produces results.  Were one to die (a bug, an exception nobody foresaw), its check would be off
for the rest of the run while the loop went on pinging the watchdog.  `ThreadWatch` hooks
`threading.excepthook` for the run: the hook only records the death and wakes the loop; the loop's
`check()` raises `ThreadDied` (exit 70, the traceback in the journal) and the tree is stopped as for any
failure.  Threads not named here (a library's, a test's) go to the hook that was there before.
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable

from kimi_supervisor.exitcodes import ThreadDied
from kimi_supervisor.liveness.http import one_line

# health.HealthProber, liveness.DeepLiveness (canary, metrics), gpu_events.GpuEventWatcher, drain.MetricsSampler.
OUR_THREADS = frozenset({"health-prober", "canary", "metrics", "gpu-events", "kimi-drain-metrics"})


@dataclasses.dataclass(frozen=True)
class Death:
    thread: str
    error: str  # one line
    traceback: tuple[str, ...]


class ThreadWatch:
    def __init__(self, names: frozenset[str] = OUR_THREADS) -> None:
        self._names = names
        self.deaths: list[Death] = []  # appended by the dying thread (atomic under the GIL), read by the loop
        self._previous: Callable[[threading.ExceptHookArgs], object] | None = None
        self._wake: Callable[[], None] = lambda: None

    def install(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        if self._previous is None:
            self._previous = threading.excepthook
            threading.excepthook = self._hook

    def uninstall(self) -> None:
        if self._previous is not None and threading.excepthook == self._hook:
            threading.excepthook = self._previous
        self._previous = None

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else ""
        if name not in self._names:
            previous = self._previous or threading.__excepthook__
            previous(args)
            return
        exc_type = args.exc_type.__name__
        error = one_line(f"{exc_type}: {args.exc_value}" if args.exc_value is not None else exc_type)
        lines = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        tb = tuple(one_line(part, 500) for chunk in lines for part in chunk.rstrip("\n").split("\n"))
        self.deaths.append(Death(name, error, tb[-30:]))
        self._wake()

    def check(self) -> None:
        """Raise ThreadDied for the first of our threads that died."""
        if self.deaths:
            d = self.deaths[0]
            raise ThreadDied(
                f"the {d.thread} thread died ({d.error}): its check would be off for the rest of the run",
                detail=list(d.traceback),
            )
