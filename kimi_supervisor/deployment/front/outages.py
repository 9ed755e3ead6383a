"""What kind of restart each outage was (docs/front.md, "Metrics and status"): the front's outage window joined with
the engine deployment's history, which records how each of its runs ended (opsview/history.py `exit_code`), and
with its weight holder's state file (docs/weight-holder.md: an engine started while the holder is ready maps the
held weights instead of reading them).

The front sees only that the engine stopped serving; the engine's supervisor knows why.  The run whose end falls
in the window (from a little before it began, as a crash is seen by the front as soon as the socket refuses, to
when it ended) names the kind; none there means the engine was unreachable without a run ending.  The records are
read through records.py.
"""

from __future__ import annotations

from kimi_supervisor.deployment.front.records import EngineRecords
from kimi_supervisor.exitcodes import ExitCode

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


def outage_kind(began: float, ended: float, records: EngineRecords) -> dict[str, object]:
    """The kind of the outage [began, ended] (wall clock), the engine's exit code that says so, and whether the
    engine came back on its weight holder's weights."""
    ended_runs = records.runs_ended(began - BEFORE_S, ended)
    if ended_runs is None:
        return {"kind": UNKNOWN, "engine_exit_code": None, "holder_assisted": False}
    if not ended_runs:
        return {"kind": NO_RESTART, "engine_exit_code": None, "holder_assisted": False}
    first = min(ended_runs, key=lambda r: r.end or 0.0)
    return {
        "kind": kind_of(first.exit_code),
        "engine_exit_code": first.exit_code,
        "holder_assisted": records.holder_ready_by(ended),
    }
