"""`status` shows a deployment's front beside its engine (docs/front.md): what clients saw of each outage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_supervisor.cli.status import Snapshot, front_of, front_summary, render_front
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


def test_a_config_directory_with_an_engine_and_its_front_is_one_deployment_shown_as_its_engine(tmp_path: Path) -> None:
    """NAME.front.toml is deployment NAME too (and sorts before NAME.toml): `status` shows the engine, its front's
    line beside it (was: the front's files in the engine's place)."""
    import io

    from kimi_supervisor.cli.status import deployments

    paths = f'[paths]\nruntime_directory = "{tmp_path}/run"\nstate_directory = "{tmp_path}/state"\n'
    (tmp_path / "kimi.toml").write_text('[child]\nargv = ["vllm", "serve", "/m"]\n' + paths)
    (tmp_path / "kimi.front.toml").write_text('[deployment]\nrole = "front"\n[front]\nport = 8123\n' + paths)
    [found] = deployments(tmp_path, io.StringIO())
    assert (found.name, found.role) == ("kimi", Role.ENGINE)
