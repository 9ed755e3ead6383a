"""What the supervisor measures about a start itself, beside vLLM's own lines (child/loadphases.py).

* before the spawn: the shards' size and how much of them the page cache holds (host/pagecache.py, sampled
  mincore), in vLLM's load order;
* while starting: bytes the child's tree read from storage (host/procio.py) and their rate over the last 10 s,
  which STATUS= shows while weights load (`loading weights 68/119 (57%), 4m12s, 1.02 GB/s`);
* at the end of the start: the run record's load fields (opsview/history.py), effective GB/s being the
  checkpoint's bytes over vLLM's `Loading weights took` (what the loader achieved, cache hits included), the
  storage's share being `read_bytes`.

Nothing here may stop a start: a model that is not a local directory, or a file that cannot be asked about,
is reported as unknown.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kimi_supervisor.child.loadphases import LoadBreakdown
from kimi_supervisor.host import pagecache
from kimi_supervisor.host.procident import ProcIdent
from kimi_supervisor.host.procio import TreeReadMeter, format_rate, read_bytes
from kimi_supervisor.host.proctable import ProcessTable


class LoadWatch:
    def __init__(self, model: str | None, table: ProcessTable, read: Any = read_bytes) -> None:
        self._model = Path(model) if model and Path(model).is_absolute() else None
        self._table = table
        self.meter = TreeReadMeter(read=read)
        self.checkpoint_bytes: int | None = None
        self.cached_fraction: float | None = None

    def before_spawn(self) -> None:
        if self._model is None or not self._model.is_dir():
            return
        shards = pagecache.shards_in_load_order(self._model)
        found = pagecache.residency(shards)
        self.checkpoint_bytes = found.total_bytes if not found.unknown else None
        self.cached_fraction = found.fraction if not found.unknown else None

    def sample(self, now: float, root_pid: int) -> None:
        root = self._table.get(root_pid)
        if root is None:
            return
        members: Iterable[ProcIdent] = [p.ident for p in (root, *self._table.descendants(root_pid))]
        self.meter.sample(now, members)

    def rate_text(self) -> str | None:
        rate = self.meter.rate()
        return format_rate(rate) if rate is not None and rate > 0 else None

    def record(self, b: LoadBreakdown) -> dict[str, Any]:
        """The run record's load fields (history.LOAD_FIELDS)."""

        def r3(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        return {
            "fs_type": b.fs_type,
            "weights_s": b.weights_s,
            "post_processing_s": r3(b.post_processing_s),
            "compile_s": b.compile_s,
            "compile_cache": b.compile_cache,
            "graphs_s": b.graphs_s,
            "init_engine_s": b.init_engine_s,
            "checkpoint_bytes": self.checkpoint_bytes,
            "cached_fraction": None if self.cached_fraction is None else round(self.cached_fraction, 4),
            "read_bytes": self.meter.latest.total_bytes if self.meter.latest.members else None,
        }
