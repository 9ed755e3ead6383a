"""The state file, history and `kimi-supervisor status` through whole runs of the real CLI and the fake vLLM."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kimi_supervisor.opsview.statefile import TOP_LEVEL_KEYS
from testkit.harness import REPO, Run, fake_config, fake_tree_of
from tests.conftest import wait_for


def status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )


def status_json(config: Path) -> dict[str, Any]:
    result = status(config, "--json")
    [data] = json.loads(result.stdout)
    assert isinstance(data, dict)
    assert result.returncode == (0 if data["running"] else 3), result.stderr
    return data


def metrics(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def state_doc(path: Path) -> dict[str, Any] | None:
    """The state file as the supervisor last wrote it (atomically), or None before its first write.

    Tests poll this file, which costs nothing; each `status` subprocess costs a Python start-up and is
    kept for the checks of what `status` itself says."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return doc


@contextlib.contextmanager
def frozen(marker: str) -> Iterator[None]:
    """SIGSTOP the fake vLLM's tree for the block: a phase (loading) holds still while `status` looks at it,
    however slow the machine, instead of a load made long enough to be caught."""
    tree = fake_tree_of(marker)
    for p in tree:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)


def test_state_file_and_status_through_a_lifecycle(tmp_path: Path) -> None:
    prom = tmp_path / "textfile" / "kimi_supervisor.prom"
    prom.parent.mkdir()
    # The load holds after its first shard until the test has looked (a 2 s load caught "while loading" only as
    # long as the machine is fast enough: seen failing with the whole load done before the tree was frozen).
    release = tmp_path / "release-load"
    fake_args = ["--load-seconds", "2", "--shards", "12", "--hold-load-until", str(release)]
    config = fake_config(tmp_path, fake_args, metrics={"textfile": str(prom)})
    state_file = tmp_path / "run" / "kimi" / "state.json"
    before = status(config)
    assert before.returncode == 3
    assert f"not running (no state file at {state_file})" in before.stdout

    run = Run(config, tmp_path)
    try:
        # While loading: progress in the state file and in the report, the tree by role with real PIDs.
        wait_for(lambda: ((state_doc(state_file) or {}).get("loading") or {}).get("shards_done"), timeout=20)
        with frozen(str(tmp_path)):
            loading = status_json(config)
            text = status(config)
        doc = loading["state"]
        assert tuple(doc) == TOP_LEVEL_KEYS
        assert doc["phase"] == "starting" and doc["supervisor"]["pid"] == run.proc.pid
        assert doc["loading"]["shards_total"] == 12 and doc["loading"]["phase"] == "loading weights"
        assert doc["loading"]["shards_done"] > 0
        assert doc["canary"] == {"ok": None, "latency_s": None, "at": None}
        assert stat.S_IMODE(state_file.stat().st_mode) == 0o644
        assert text.returncode == 0
        assert text.stdout.startswith("● kimi-supervisor@kimi - starting: ")
        assert "    Progress: [" in text.stdout and "/12 shards" in text.stdout
        assert "\x1b[" not in text.stdout  # no colours into a pipe
        release.touch()

        ready = run.wait_event("state.ready")
        wait_for(lambda: (lambda d: d and d["phase"] == "ready" and d["health"]["ok"] is True)(state_doc(state_file)))
        doc = status_json(config)
        st = doc["state"]
        assert st["phase"] == "ready"
        tree = {p.pid for p in fake_tree_of(str(tmp_path))}
        roles = sorted((p["role"], p["rank"]) for p in st["processes"])
        assert roles == [("api_server", None), ("engine_core", None), ("worker", 0), ("worker", 1)]
        assert {p["pid"] for p in st["processes"]} == set(tree)
        assert [p["label"] for p in st["processes"]][-2:] == ["Worker_TP0", "Worker_TP1"]
        assert st["status"] == ready["status"] and st["ready_at"] is not None and st["loading"] is None
        health = st["health"]
        # A probe that succeeded answered within its timeout (health.timeout_s, 1 s in fake_sections): the latency
        # is the one measured, whatever this machine's speed.
        assert health["ok"] is True and 0 < health["latency_s"] <= 1.0 and health["consecutive_failures"] == 0
        report = status(config).stdout
        assert report.startswith("● kimi-supervisor@kimi - ready: serving on http://127.0.0.1:")
        assert "Worker_TP1" in report and "Health: ok, " in report and "Uptime: ready for " in report

        m = metrics(prom)
        assert m["kimi_supervisor_state"] == [
            ({"deployment": "kimi", "role": "engine", "state": s}, 1.0 if s == "ready" else 0.0)
            for s in ("preflight", "starting", "ready", "stopping", "stopped", "failed")
        ]
        assert m["kimi_supervisor_ready_timestamp_seconds"][0][1] == st["ready_at"]
        assert m["kimi_supervisor_last_load_seconds"][0][1] == ready["startup_s"]
        assert m["kimi_supervisor_restarts_total"] == [({"deployment": "kimi", "role": "engine"}, 0.0)]
        assert m["kimi_supervisor_start_timestamp_seconds"] == [
            ({"deployment": "kimi", "role": "engine"}, st["started_at"])
        ]
        assert stat.S_IMODE(prom.stat().st_mode) == 0o644

        run.signal(signal.SIGTERM)
        assert run.wait() == 0
    finally:
        run.kill()
    after = status(config)
    assert after.returncode == 3
    assert after.stdout.startswith("○ kimi-supervisor@kimi - not running (stopped at ")
    data = status_json(config)
    assert data["state"]["phase"] == "stopped" and data["state"]["exit_code"] == 0
    [only] = data["runs"]
    assert only["exit_code"] == 0 and only["load_s"] == ready["startup_s"] and only["end"] is not None
    assert "stopped on request" in after.stdout

    # The next start predicts its load from this one before any shard loads, then from the shard rate.
    # Shards load for 2.1 s: progress STATUS= goes out at most once a second.
    config = fake_config(tmp_path, ["--load-seconds", "3", "--shards", "6"], metrics={"textfile": str(prom)})
    run2 = Run(config, _subdir(tmp_path, "second"))
    try:
        run2.wait_event("state.ready")
        statuses = [f["STATUS"] for f in run2.notify.fields() if "STATUS" in f]
        loading_lines = [s for s in statuses if s.startswith("starting: ")]
        # Before the first shard: only the last load can say how long this one takes.
        assert any(s.endswith(" left") and "loading weights" not in s for s in loading_lines), loading_lines
        assert any(s.startswith("starting: loading weights ") and s.endswith(" left") for s in loading_lines)
        m = metrics(prom)
        assert m["kimi_supervisor_restarts_total"] == [({"deployment": "kimi", "role": "engine"}, 1.0)]
        run2.signal(signal.SIGTERM)
        assert run2.wait() == 0
    finally:
        run2.kill()
    runs = status_json(config)["runs"]
    assert [r["exit_code"] for r in runs] == [0, 0]


def test_failure_root_cause_in_state_history_metrics_and_report(tmp_path: Path) -> None:
    prom = tmp_path / "kimi_supervisor.prom"
    config = fake_config(tmp_path, ["--crash-during-load"], metrics={"textfile": str(prom)})
    run = Run(config, tmp_path)
    assert run.wait() == 11
    data = status_json(config)
    assert data["running"] is False
    failure = data["state"]["last_failure"]
    assert failure["exit_code"] == 11
    assert "torch.OutOfMemoryError: CUDA out of memory" in failure["root_cause"]
    assert data["runs"][0]["root_cause"] == failure["root_cause"] and data["runs"][0]["load_s"] is None
    report = status(config).stdout
    assert report.startswith("× kimi-supervisor@kimi - not running (failed at ")
    assert "Last failure: exit 11 at " in report
    [(labels, value)] = metrics(prom)["kimi_supervisor_last_failure_info"]
    assert value == 1.0 and labels == {
        "deployment": "kimi",
        "role": "engine",
        "exit_code": "11",
        "reason": "startup_failed",
    }
    [(labels, when)] = metrics(prom)["kimi_supervisor_last_failure_timestamp_seconds"]
    assert labels["reason"] == "startup_failed" and when == status_json(config)["state"]["last_failure"]["at"]


def test_supervisor_killed_leaves_a_stale_state_file_status_calls_out(tmp_path: Path) -> None:
    config = fake_config(tmp_path)
    run = Run(config, tmp_path)
    try:
        run.wait_event("state.ready")
        wait_for(lambda: (state_doc(tmp_path / "run" / "kimi" / "state.json") or {}).get("phase") == "ready")
        run.proc.send_signal(signal.SIGKILL)
        run.wait()
    finally:
        run.kill()
        for p in fake_tree_of(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):  # members leave on their own once their parent died
                os.kill(p.pid, signal.SIGKILL)
    result = status(config)
    assert result.returncode == 3
    assert f"not running (supervisor PID {run.proc.pid} is gone without a final state (killed?); it was ready" in (
        result.stdout
    )
    # The next start records that run as ended without an exit.
    run2 = Run(config, _subdir(tmp_path, "second"))
    try:
        run2.wait_event("state.ready")
        runs = status_json(config)["runs"]
        assert runs[1]["root_cause"].startswith("the supervisor ended without recording an exit")
        assert "(running)" in status(config).stdout
        run2.signal()
        assert run2.wait() == 0
    finally:
        run2.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_runtime_directory_full_warns_and_keeps_serving(tmp_path: Path) -> None:
    # The instance lock needs the directory at start (exit 77 otherwise); what can happen later is /run
    # filling up under a serving supervisor.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # mode=0755: a tmpfs is 1777 by default, which the directory check refuses (test_root_writes.py).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "kimi-test-run", str(run_dir)], check=True)
    try:
        config = fake_config(tmp_path)
        run = Run(config, tmp_path)
        try:
            run.wait_event("state.ready")
            wait_for(lambda: (state_doc(run_dir / "kimi" / "state.json") or {}).get("phase") == "ready")
            filler = run_dir / "filler"
            with filler.open("wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            warning = run.wait_event("state_file.unwritable", timeout=10)
            assert "No space left on device" in warning["error"]
            time.sleep(1.5)  # more health results, more writes due: still one warning, still serving
            assert status_json(config)["state"]["phase"] == "ready"
            filler.unlink()
            run.wait_event("state_file.writable_again", timeout=10)
            run.signal()
            assert run.wait() == 0
        finally:
            run.kill()
        assert [e["event"] for e in run.events].count("state_file.unwritable") == 1
        assert run.event("supervisor.exit") is None
        assert status_json(config)["state"]["phase"] == "stopped"
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], check=False)


def test_corrupt_history_is_set_aside_and_the_run_goes_on(tmp_path: Path) -> None:
    history = tmp_path / "state" / "kimi" / "history.json"
    history.parent.mkdir(parents=True)
    history.write_text('{"schema": 1, "runs": [{"start": "yesterday"}]')
    config = fake_config(tmp_path)
    run = Run(config, tmp_path)
    try:
        run.wait_event("state.ready")
        run.signal()
        assert run.wait() == 0
    finally:
        run.kill()
    corrupt = run.event("history.corrupt")
    assert corrupt is not None
    aside = Path(corrupt["set_aside_as"])
    assert aside.name.startswith("history.json.corrupt-") and aside.read_text().startswith('{"schema": 1')
    assert [r["exit_code"] for r in json.loads(history.read_text())["runs"]] == [0]


def _subdir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def test_canary_results_reach_the_state_file_the_report_and_the_metrics(tmp_path: Path) -> None:
    prom = tmp_path / "kimi_supervisor.prom"
    config = fake_config(
        tmp_path, liveness={"canary_interval_s": 0.3, "when": "always"}, metrics={"textfile": str(prom)}
    )
    run = Run(config, tmp_path)
    try:
        run.wait_event("state.ready")
        state_file = tmp_path / "run" / "kimi" / "state.json"
        wait_for(lambda: ((state_doc(state_file) or {}).get("canary") or {}).get("ok"), timeout=15)
        canary = status_json(config)["state"]["canary"]
        # A canary that passed answered within its timeout (liveness.canary_timeout_s, 10 s by default).
        assert canary["ok"] is True and 0 < canary["latency_s"] < 10.0 and canary["at"] is not None
        assert "      Canary: ok, " in status(config).stdout
        wait_for(lambda: "kimi_supervisor_canary_latency_seconds" in metrics_or_empty(prom), timeout=10)
        [(_, value)] = metrics(prom)["kimi_supervisor_canary_latency_seconds"]
        assert 0 < value < 10.0
        run.signal()
        assert run.wait() == 0
    finally:
        run.kill()


def metrics_or_empty(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    return metrics(path) if path.exists() else {}


def test_status_finds_a_deployment_run_from_a_config_elsewhere_without_config(tmp_path: Path) -> None:
    """The demo's way: a config outside /etc/kimi-supervisor with [paths] of its own (.demo-state/): `status` (and
    `status NAME`) finds it through the supervisor's command line in the process table (was: "no deployment named
    ..." unless given --config)."""
    from kimi_supervisor.cli.status import run_status, running_configs

    name = f"elsewhere-{os.getpid()}"  # another test's supervisor may run beside this one
    config = fake_config(tmp_path, deployment={"name": name})
    run = Run(config, tmp_path)
    try:
        run.wait_event("state.ready")
        assert config in running_configs()
        out = io.StringIO()
        rc = run_status(None, False, False, out=out, name=name, config_dir=tmp_path / "none", running=running_configs)
        assert rc == 0 and out.getvalue().startswith(f"● kimi-supervisor@{name} - ready: serving on "), out.getvalue()
    finally:
        run.kill()


@pytest.mark.parametrize(
    ("argv", "config"),
    [
        (["/opt/k/bin/kimi-supervisor", "--config", "/etc/k/a.toml"], "/etc/k/a.toml"),
        (["/opt/k/bin/python3", "/opt/k/bin/kimi-supervisor", "--config", "etc/demo.toml"], "etc/demo.toml"),
        (["python3", "-m", "kimi_supervisor", "run", "--config", "x.toml", "--log-format", "json"], "x.toml"),
        (["/opt/k/bin/kimi-supervisor"], "/etc/kimi-supervisor/kimi-supervisor.toml"),
        (["/opt/k/bin/kimi-supervisor", "--config", "a.toml", "--dry-run"], None),  # runs nothing
        (["/opt/k/bin/kimi-supervisor", "status", "--config", "a.toml"], None),
        (["/opt/k/bin/kimi-supervisor", "--no-such-option"], None),
        (["vim", "kimi-supervisor.toml"], None),
    ],
)
def test_a_supervisors_config_is_read_off_its_command_line(argv: list[str], config: str | None) -> None:
    from kimi_supervisor.cli.status import run_config

    assert run_config(argv) == (None if config is None else Path(config))
