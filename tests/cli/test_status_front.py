"""`status` shows a deployment's front beside its engine (docs/front.md): what clients saw of each outage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_supervisor.cli.status import Snapshot, front_of, front_summary, render_front, render_spare, spare_of
from kimi_supervisor.config import layout
from kimi_supervisor.config.model import PathsConfig
from kimi_supervisor.opsview.history import HistoryData
from kimi_supervisor.roles import Role

NOW = 1_000_000.0


def snap(state: dict[str, Any] | None, running: bool = True) -> Snapshot:
    return Snapshot("kimi", running, "PID 7", state, Path("s"), HistoryData(), Path("h"), None, Role.FRONT)


def test_the_front_line_says_what_the_last_outage_cost_clients() -> None:
    outages = [
        {
            "began": NOW - 900,
            "ended": NOW - 880,
            "client_wait_s": 3.0,
            "held": 1,
            "retried": 0,
            "resumed": 0,
            "failed": 0,
        },
        {
            "began": NOW - 100,
            "ended": NOW - 62.5,
            "client_wait_s": 41.25,
            "held": 3,
            "retried": 2,
            "resumed": 5,
            "failed": 0,
        },
    ]
    state = {
        "phase": "ready",
        "front": {"engine_serving": True, "held": 0, "requests": {"resumed": 5}, "outages": outages},
    }
    summary = front_summary(snap(state))
    assert summary["outages"] == outages and summary["requests"] == {"resumed": 5}
    assert render_front(snap(state), NOW) == (
        "       Front: ready, engine serving, 0 held now; 2 outage(s), the last 37.5s: clients waited 41.2s, "
        "held 3, retried 2, resumed 5, failed 0\n"
    )
    assert render_front(snap({"phase": "stopped", "front": {"outages": []}}, running=False), NOW) == (
        "       Front: not running\n"
    )


def test_the_fronts_state_file_is_found_beside_the_engines(tmp_path: Path) -> None:
    dirs = layout.directories(PathsConfig(tmp_path / "run", tmp_path / "state"), "kimi")
    assert front_of(dirs) is None
    (tmp_path / "run" / "kimi" / "front-state").mkdir(parents=True)
    (tmp_path / "run" / "kimi" / "front-state" / "state.front.json").write_text("{}")
    found = front_of(dirs)
    assert found is not None and found.state_file == tmp_path / "run" / "kimi" / "front-state" / "state.front.json"
    assert front_of(found) is None  # only an engine's files name the supervisors beside it


def test_the_front_line_says_which_engine_serves_the_spares_readiness_and_the_last_failover(tmp_path: Path) -> None:
    """docs/spare.md: `status` says where new requests go, whether a spare is ready, and what the last failover took;
    the spare supervisor's own line is found beside the engine's files."""
    spare = {
        "configured": True,
        "ready": False,
        "without_ready_s": 42.4,
        "alert_s": 600,
        "failovers": [{"at": NOW - 50, "died": "main", "to": "spare", "first_request_s": 0.125}],
    }
    state = {"phase": "ready", "front": {"engine_serving": True, "held": 0, "serving_engine": "main", "spare": spare}}
    assert render_front(snap(state), NOW) == (
        "       Front: ready, engine serving, 0 held now, new requests to main, no ready spare for 42s, 1 failover(s), "
        "the last 0.12s from the death to the first request\n"
    )
    assert front_summary(snap(state))["spare"] == spare
    dirs = layout.directories(PathsConfig(tmp_path / "run", tmp_path / "state"), "kimi")
    assert spare_of(dirs) is None
    (tmp_path / "run" / "kimi").mkdir(parents=True)
    (tmp_path / "run" / "kimi" / "state.spare.json").write_text("{}")
    found = spare_of(dirs)
    assert found is not None and found.role is Role.SPARE
    line = render_spare(Snapshot("kimi", True, "PID 8", {"phase": "ready", "status": "serving"}, Path("s"),
                                 HistoryData(), Path("h"), None, Role.SPARE))  # fmt: skip
    assert line == "       Spare: ready, serving\n"
