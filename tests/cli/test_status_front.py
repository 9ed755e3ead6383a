"""`status` shows a deployment's front beside its engine (docs/front.md): what clients saw of each outage."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli.status import (
    Snapshot,
    front_of,
    front_summary,
    gather,
    render_front,
    render_spare,
    spare_of,
)
from kimi_supervisor.config import layout
from kimi_supervisor.config.model import PathsConfig
from kimi_supervisor.opsview.history import HistoryData
from kimi_supervisor.opsview.statefile import process_start_time
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


def front_file(tmp_path: Path, front: object) -> Snapshot:
    """The front's state file as a hostile front account could write it, its writer alive (this test), gathered."""
    dirs = layout.directories(PathsConfig(tmp_path / "run", tmp_path / "state"), "kimi")
    (tmp_path / "run" / "kimi" / "front-state").mkdir(parents=True)
    (tmp_path / "run" / "kimi" / "front-state" / "state.front.json").write_text("{}")
    found = front_of(dirs)
    assert found is not None
    me = {"pid": os.getpid(), "start_time": process_start_time(os.getpid()), "version": "x", "config": ""}
    doc = {"schema": 1, "supervisor": me, "phase": "ready", "status": "serving", "front": front}
    found.state_file.write_text(json.dumps(doc))
    return gather(found)


ESC = "\x1b]0;owned\x07\x1b[2J"
GOOD_OUTAGE = {"began": 1.0, "ended": 2.0, "client_wait_s": 1.0, "held": 1, "retried": 0, "resumed": 0, "failed": 0}


@pytest.mark.parametrize(
    ("front", "key"),
    [
        ("x", "front: expected an object, got str"),
        ({"held": ESC}, "front.held: expected an integer, got str"),
        ({"outages": [GOOD_OUTAGE | {"client_wait_s": "soon"}]}, "front.outages[0].client_wait_s: expected a number"),
        ({"outages": [GOOD_OUTAGE | {"retried": ESC}]}, "front.outages[0].retried: expected an integer, got str"),
        ({"outages": [GOOD_OUTAGE | {"kind": "k" * 41}]}, "front.outages[0].kind: longer than 40 characters"),
        ({"outages": "soon"}, "front.outages: expected a list, got str"),
        ({"requests": {ESC: 1}}, "front.requests."),
        ({"serving_engine": ESC * 10}, "front.serving_engine: longer than 40 characters"),
        ({"spare": {"configured": True, "without_ready_s": "soon"}}, "front.spare.without_ready_s: expected a number"),
        ({"spare": {"failovers": [{"first_request_s": "soon"}]}}, "front.spare.failovers[0].first_request_s: expected"),
    ],
)
def test_a_front_state_file_root_must_not_trust_is_refused_naming_the_key_and_nothing_of_it_shown(
    tmp_path: Path, front: object, key: str
) -> None:
    """The front's file is written by the account that parses every client's request; root's `status NAME` reads
    it. Checked like the engine's own (was: `"front": "x"` and `client_wait_s: "soon"` crashed status, exit 70, and an
    escape sequence reached root's terminal); the note names the key, escaped."""
    found = front_file(tmp_path, front)
    assert not found.running and found.note is not None and key in found.note
    line = render_front(found, NOW)
    assert line.startswith("       Front: not running (state file unreadable: ") and key in line
    assert "\x1b" not in line and "\x07" not in line
    assert front_summary(found)["note"] == found.note


def test_every_value_the_front_line_shows_is_escaped() -> None:
    """Past the check, what is shown is escaped anyway: the phase, the kind, every count."""
    state = {
        "phase": "ready\x1b[2J",
        "front": {"engine_serving": False, "held": 2, "outages": [GOOD_OUTAGE | {"kind": "crash\x1b]0;x\x07"}]},
    }
    line = render_front(snap(state), NOW)
    assert "\x1b" not in line and "\x07" not in line
    assert line.startswith(
        "       Front: ready\\x1b[2J, engine not serving, 2 held now; 1 outage(s), the last 1.0s (crash"
    )


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
