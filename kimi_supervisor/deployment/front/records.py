"""The engine's records as the front reads them (docs/front.md): its supervisor's state file (phase, load ETA), its
history (the last load; the runs that ended in a window) and its weight holder's state file (ready, since when).

The one reader of them in the front: the watch (engine.py's probe), the hold bound (hold_bound here, for the gate
and for role.py's `--dry-run`) and an outage's kind (outages.py) ask here; nothing here imports aiohttp.  A state
file counts only while its writer runs (opsview/statefile.py read_live_state); the history is read without setting
a corrupt file aside, as it is the engine supervisor's file, not the front's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.opsview.history import RunRecord, load_history
from kimi_supervisor.opsview.statefile import read_live_state

# A hold without history: a restart with the weight holder takes 5-7 s on the H200 with stand-ins, a minute or
# more with the real model (docs/weight-holder.md); with a history, its last load decides (docs/front.md, Holding).
DEFAULT_HOLD_S = 120.0
HOLD_MARGIN_S = 30.0
HOLD_BOUNDS_S = (60.0, 900.0)


@dataclasses.dataclass(frozen=True)
class EnginePhase:
    phase: str | None  # its supervisor's phase (opsview/statefile.py PHASES); None when the file has none
    eta_s: float | None  # its load's ETA, while it loads


@dataclasses.dataclass(frozen=True)
class EngineRecords:
    """Where one engine's records are; None: that record is not kept for it (then nothing is read)."""

    state_file: Path | None = None
    history_file: Path | None = None
    holder_state_file: Path | None = None

    @classmethod
    def of(cls, cfg: FrontConfig) -> EngineRecords:
        """The front's one engine, as its config names it."""
        return cls(cfg.engine_state_file, cfg.engine_history_file, cfg.engine_holder_state_file)

    def phase(self) -> EnginePhase | None:
        """Its supervisor's phase and load ETA; None without a live writer."""
        doc = None if self.state_file is None else read_live_state(self.state_file)
        if doc is None:
            return None
        loading = doc.get("loading") or {}
        eta = loading.get("eta_s") if isinstance(loading, dict) else None
        phase = doc.get("phase")
        return EnginePhase(
            phase if isinstance(phase, str) else None, float(eta) if isinstance(eta, (int, float)) else None
        )

    def output_key(self) -> str | None:
        """What decides its tokens, hashed, as its live supervisor recorded it (docs/spare.md); None without one."""
        doc = None if self.state_file is None else read_live_state(self.state_file)
        key = None if doc is None else doc.get("output_key")
        return key if isinstance(key, str) else None

    def last_load_s(self) -> float | None:
        """Its last successful load's seconds; None without a history or a successful load in it."""
        if self.history_file is None:
            return None
        last = load_history(self.history_file, set_aside=False).last_successful_load()
        return None if last is None else last.load_s

    def runs_ended(self, since: float, until: float) -> list[RunRecord] | None:
        """Its runs whose end falls in [since, until] (wall clock); None when there is no history to look in."""
        if self.history_file is None or not self.history_file.exists():
            return None
        runs = load_history(self.history_file, set_aside=False).runs
        return [r for r in runs if r.end is not None and since <= r.end <= until]

    def holder_ready_by(self, at: float) -> bool:
        """Its weight holder was ready (its writer alive) at `at` (wall clock)."""
        doc = None if self.holder_state_file is None else read_live_state(self.holder_state_file)
        if doc is None or doc.get("phase") != "ready":
            return False
        ready = doc.get("ready_at")
        return isinstance(ready, (int, float)) and ready <= at


class HoldBound(NamedTuple):
    seconds: float
    whence: str  # where the number came from (`--dry-run` says it)


def hold_bound(cfg: FrontConfig) -> HoldBound:
    """How long a request waits for the engine: front.hold_s, else the engine's last successful load plus a margin,
    within bounds; DEFAULT_HOLD_S without one."""
    if cfg.hold_s is not None:
        return HoldBound(cfg.hold_s, "front.hold_s")
    last = EngineRecords.of(cfg).last_load_s()
    if last is None:
        return HoldBound(DEFAULT_HOLD_S, "no engine history yet")
    low, high = HOLD_BOUNDS_S
    return HoldBound(
        min(high, max(low, last + HOLD_MARGIN_S)), f"the engine's last load {last:g}s + {HOLD_MARGIN_S:g}s"
    )
