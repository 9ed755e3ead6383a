"""A start refused before its run (exit 16, 78) still says `failed` where the operator looks (docs/operators-view.md),
and a start refused because this very deployment runs leaves the running one's state alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kimi_supervisor.config import layout
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ExitCode
from testkit.harness import REPO, Run, fake_config, fake_tree_of, free_port, write_config
from tests.cli.test_status_lifecycle import metrics
from tests.host.test_instance_lock import hold_lock

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def state_of(prom: Path) -> str:
    assert prom.exists(), f"no textfile {prom}"
    [state] = [labels["state"] for labels, value in metrics(prom)["kimi_supervisor_state"] if value == 1.0]
    return state


def wait_for_state(prom: Path, state: str, timeout: float = 30) -> None:
    """The textfile follows the state event within a write (opsview/view.py): wait for it, bounded."""
    deadline = time.monotonic() + timeout
    while not (prom.exists() and state_of(prom) == state):
        if time.monotonic() > deadline:
            raise AssertionError(f"{prom} never said {state} within {timeout}s")
        time.sleep(0.05)


def runs(config: Path) -> list[dict[str, Any]]:
    path = layout.of(load_config(config)).history_file
    return list(json.loads(path.read_text())["runs"]) if path.exists() else []


def start(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(config), "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def variant(base: Path, path: Path, name: str, textfile: Path, **changes: dict[str, Any]) -> Path:
    """`base`'s config as deployment `name` writing `textfile` (same paths, same port)."""
    sections = tomllib.loads(base.read_text())
    sections["deployment"] = {"name": name}
    sections["metrics"] = {"textfile": str(textfile)}
    for key, value in changes.items():
        sections.setdefault(key, {}).update(value)
    return write_config(path, sections)


def test_a_refused_start_is_failed_in_textfile_and_history_never_over_a_running_one(tmp_path: Path) -> None:
    prom_dir = tmp_path / "textfiles"
    prom_dir.mkdir(mode=0o755)
    kimi_prom, other_prom = prom_dir / "kimi.prom", prom_dir / "other.prom"
    config = fake_config(tmp_path, deployment={"name": "kimi"}, metrics={"textfile": str(kimi_prom)})
    run = Run(config, tmp_path)
    try:
        run.wait_event("state.ready", timeout=60)
        wait_for_state(kimi_prom, "ready")

        # The same deployment started again from a shell while it serves: 16, and its files stay the running
        # one's (its `ready`, its one run).
        twin = start(variant(config, tmp_path / "twin.toml", "kimi", kimi_prom))
        assert twin.returncode == ExitCode.ANOTHER_INSTANCE, twin.stderr[-2000:]
        assert state_of(kimi_prom) == "ready" and len(runs(config)) == 1

        # Another deployment on the same port: refused, and that deployment is down, so its own textfile and
        # history say so (was: no file at all, no run).
        other = variant(config, tmp_path / "other.toml", "other", other_prom)
        refused = start(other)
        assert refused.returncode == ExitCode.ANOTHER_INSTANCE, refused.stderr[-2000:]
        assert state_of(other_prom) == "failed"
        [(labels, _)] = metrics(other_prom)["kimi_supervisor_last_failure_info"]
        assert (labels["exit_code"], labels["reason"], labels["deployment"]) == ("16", "another_instance", "other")
        [only] = runs(other)
        assert only["exit_code"] == ExitCode.ANOTHER_INSTANCE and "port" in only["root_cause"]
        assert state_of(kimi_prom) == "ready"  # the winner's untouched

        run.signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 0
    finally:
        run.kill()
    assert state_of(kimi_prom) == "stopped"

    # The case: after a stop, a restart refused by its config (78) said `stopped` for ever, which
    # silences KimiSupervisorNotServing, and added no run, so KimiSupervisorRestartingRepeatedly never fired.
    broken = variant(
        config,
        tmp_path / "kimi.toml",
        "kimi",
        kimi_prom,
        child={"argv": [*load_config(config).child.argv, "--shutdown-timeout", "30"]},
    )
    refused = start(broken)
    assert refused.returncode == ExitCode.CONFIG, refused.stderr[-2000:]
    assert "shutdown.grace_s" in refused.stderr
    assert state_of(kimi_prom) == "failed"
    got = metrics(kimi_prom)
    [(labels, _)] = got["kimi_supervisor_last_failure_info"]
    assert (labels["exit_code"], labels["reason"]) == ("78", "config")
    assert [value for _, value in got["kimi_supervisor_restarts_total"]] == [1.0]
    assert [r["exit_code"] for r in runs(broken)] == [0, ExitCode.CONFIG]
    assert fake_tree_of(str(tmp_path)) == []
    assert [json.loads(line)["event"] for line in twin.stderr.splitlines()] == ["supervisor.exit"]  # one line


def test_a_start_refused_for_its_nccl_ras_port_is_recorded_failed_naming_the_owner(tmp_path: Path) -> None:
    """The child's NCCL RAS port is one of the supervisor's locked resources (host/instance_lock.py): another
    supervisor holding it refuses the start (16) like a taken GPU or serving port does, and the refusal is
    recorded where the operator looks (was: a second lock taken after the recording, so 16 with no trace)."""
    prom_dir = tmp_path / "textfiles"
    prom_dir.mkdir(mode=0o755)
    prom = prom_dir / "kimi.prom"
    ras = free_port()
    env = {"KIMI_TEST_MARKER": str(tmp_path), "NCCL_RAS_ADDR": f"127.0.0.1:{ras}"}
    config = fake_config(tmp_path, deployment={"name": "kimi"}, metrics={"textfile": str(prom)}, child={"env": env})
    owner = hold_lock(tmp_path / "run", [], ras)
    try:
        refused = start(config)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert refused.returncode == ExitCode.ANOTHER_INSTANCE, refused.stderr[-2000:]
    named = f"another kimi-supervisor (PID {owner.pid}) owns port {ras}"
    assert named in refused.stderr
    assert state_of(prom) == "failed"
    [(labels, _)] = metrics(prom)["kimi_supervisor_last_failure_info"]
    assert (labels["exit_code"], labels["reason"], labels["deployment"]) == ("16", "another_instance", "kimi")
    [only] = runs(config)
    assert only["exit_code"] == ExitCode.ANOTHER_INSTANCE and named in only["root_cause"]
    state = json.loads(layout.of(load_config(config)).state_file.read_text())
    assert state["phase"] == "failed" and named in json.dumps(state)
    assert fake_tree_of(str(tmp_path)) == []
