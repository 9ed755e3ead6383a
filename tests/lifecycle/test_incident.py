"""A stop the supervisor decides on keeps its evidence first: the incident file, named in the history record, the
state file's last failure, `status NAME` and the failure's journal record; a requested stop takes none."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

from kimi_supervisor.cli.status import gather, render_text
from kimi_supervisor.config import layout
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.lifecycle.supervisor import WATCHDOG_LEAD_S
from kimi_supervisor.opsview.history import load_history
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle_world import HEALTH_LINE, serving_world


def test_unhealthy_stop_saves_the_incident_before_sigterm_and_names_it_everywhere(tmp_path: Path) -> None:
    spawned: list[bool] = []  # vLLM holds its 70000 MiB from the spawn on
    probe = FakeGpuProbe([FakeGpu(occupants={4242: 70000})], alive=lambda pid: bool(spawned))
    w = serving_world(tmp_path, preflight={"gpus": [0]}, probe=probe)
    w.script = lambda child: spawned.append(True)
    w.health = lambda t: 200 if 1.0 <= t < 3.0 else (None if t < 1.0 else 500)
    w.say_at(2.0, HEALTH_LINE)
    assert w.run() == ExitCode.CHILD_UNHEALTHY
    assert w.child is not None
    [(dumped_at, pid)] = w.dumped
    (term_at, term), *_ = w.child.signals
    assert pid == w.child.pid and term == signal.SIGTERM and dumped_at <= term_at
    names = w.names()
    assert names.index("incident.saved") < names.index("stop.sigterm")
    path = str(w.events("incident.saved")[0]["path"])
    dirs = layout.of(w.cfg)
    assert Path(path).parent == dirs.state / "incidents"
    doc = json.loads(Path(path).read_text())
    assert doc["exit_code"] == ExitCode.CHILD_UNHEALTHY and "busy_loop" in doc["stacks"][0]["text"]
    assert doc["gpus"][0]["memory"]["used_mib"] == 70000
    assert w.events("state.failed")[0]["incident"] == path  # the failure's journal record
    assert load_history(dirs.history_file).runs[-1].incident == path
    text = render_text(gather(dirs), w.clock.time())
    assert f"Incident: {path}" in text


def test_a_requested_stop_takes_no_incident(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.signal_at(3.0)
    assert w.run() == ExitCode.OK
    assert w.dumped == [] and not w.events("incident.saved")
    assert not (layout.of(w.cfg).state / "incidents").exists()


def test_a_failing_capture_changes_neither_the_stop_nor_the_exit_code(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.health = lambda t: 200 if 1.0 <= t < 3.0 else (None if t < 1.0 else 500)

    def broken() -> tuple[None, str]:
        raise RuntimeError("a bug in the capture")

    w.supervisor.deps = dataclasses.replace(w.supervisor.deps, dumper=broken)
    assert w.run() == ExitCode.CHILD_UNHEALTHY
    assert w.events("incident.failed")[0]["error"] == "RuntimeError: a bug in the capture"
    assert "stop.tree_gone" in w.names() and "incident" not in w.events("state.failed")[0]


def test_the_watchdogs_coming_kill_takes_the_evidence_once_and_names_it_in_the_run(tmp_path: Path) -> None:
    # /health fails from 3 s on, tolerated: the pings stop, systemd would SIGABRT at the last ping + 12 s.
    w = serving_world(tmp_path, watchdog_s=12.0, health={"interval_s": 0.3, "timeout_s": 1, "failures_tolerated": 500})
    w.health = lambda t: 200 if 1.0 <= t < 3.0 else (None if t < 1.0 else 500)
    w.signal_at(14.0)  # the stand-in for systemd's SIGABRT
    assert w.run() == ExitCode.OK
    [last_ping] = w.notes.times("WATCHDOG", 1)[-1:]
    [(dumped_at, _)] = w.dumped  # once, not at every turn after
    assert last_ping + 12.0 - WATCHDOG_LEAD_S <= dumped_at < last_ping + 12.0 - WATCHDOG_LEAD_S + 0.5
    path = str(w.events("incident.saved")[0]["path"])
    assert path.endswith("-watchdog.json")
    doc = json.loads(Path(path).read_text())
    assert doc["exit_code"] is None and doc["reason"].startswith("systemd's watchdog fires in")
    assert load_history(layout.of(w.cfg).history_file).runs[-1].incident == path  # kept through the run's end


def test_a_short_watchdog_on_a_healthy_server_takes_no_evidence(tmp_path: Path) -> None:
    w = serving_world(tmp_path, watchdog_s=3.0)
    w.say_at(2.0, HEALTH_LINE)
    w.signal_at(12.0)
    assert w.run() == ExitCode.OK
    assert len(w.notes.times("WATCHDOG", 1)) >= 6 and w.dumped == []
