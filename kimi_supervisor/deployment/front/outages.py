"""What kind of restart each outage was (docs/front.md, "Metrics and status"): the front's outage window joined with
the engine deployment's history, which records how each of its runs ended (opsview/history.py `exit_code`), and
with its weight holder's state file (docs/weight-holder.md: an engine started while the holder is ready maps the
held weights instead of reading them).

The front sees only that the engine stopped serving; the engine's supervisor knows why.  The run whose end falls
in the window (from a little before it began, as a crash is seen by the front as soon as the socket refuses, to
when it ended) names the kind; none there means the engine was unreachable without a run ending.
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.opsview.history import load_history
from kimi_supervisor.opsview.statefile import read_state, writer_alive
from kimi_supervisor.untrusted_json import Untrusted

# How the engine's run ended (its supervisor's exit code, docs/operators-view.md) as the kind of its outage.
KINDS = {
    ExitCode.OK: "planned",  # stopped on request: systemctl stop or restart, a config change
    ExitCode.CHILD_DIED: "crash",  # the engine's tree died under it (a SIGKILLed EngineCore, an OOM kill)
    ExitCode.CHILD_UNHEALTHY: "unhealthy",  # /health failed failures_tolerated times: the watchdog's restart
    ExitCode.ENGINE_WEDGED: "wedged",  # /health answered, no progress: the canary's restart
    ExitCode.GPU_FAILED: "gpu",
    ExitCode.GPU_NEEDS_RESET: "gpu",
    ExitCode.PEER_LOST: "group",
    ExitCode.LEADER_LOST: "group",
}
NO_RESTART = "no restart"  # no run of the engine ended in the window
UNKNOWN = "unknown"  # no history to join with
# A run that ended this long before the front saw the outage still caused it (the two clocks are one host's wall
# clock; the margin covers the front's probe interval and the supervisor's reaping).
BEFORE_S = 5.0


def kind_of(exit_code: int | None) -> str:
    if exit_code is None:
        return UNKNOWN
    try:
        return KINDS.get(ExitCode(exit_code), f"exit {exit_code}")
    except ValueError:
        return f"exit {exit_code}"


def classify(began: float, ended: float, history: Path | None, holder_state: Path | None) -> dict[str, object]:
    """The kind of the outage [began, ended] (wall clock), the engine's exit code that says so, and whether the
    engine came back on its weight holder's weights."""
    if history is None or not history.exists():
        return {"kind": UNKNOWN, "engine_exit_code": None, "holder_assisted": False}
    runs = load_history(history, set_aside=False).runs
    ended_runs = [r for r in runs if r.end is not None and began - BEFORE_S <= r.end <= ended]
    if not ended_runs:
        return {"kind": NO_RESTART, "engine_exit_code": None, "holder_assisted": False}
    first = min(ended_runs, key=lambda r: r.end or 0.0)
    return {
        "kind": kind_of(first.exit_code),
        "engine_exit_code": first.exit_code,
        "holder_assisted": _holder_ready_by(holder_state, ended),
    }


def _holder_ready_by(holder_state: Path | None, at: float) -> bool:
    """The deployment's weight holder was ready (its writer alive) when the engine served again."""
    if holder_state is None:
        return False
    try:
        doc = read_state(holder_state)
    except (OSError, Untrusted):
        return False
    if doc is None or not writer_alive(doc) or doc.get("phase") != "ready":
        return False
    ready = doc.get("ready_at")
    return isinstance(ready, (int, float)) and ready <= at
