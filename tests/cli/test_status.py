"""`kimi-supervisor status`: golden text for fixed states, liveness, JSON, colours, --watch."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli.status import gather, render_text, run_status
from kimi_supervisor.config import layout
from kimi_supervisor.config.layout import DeploymentDirectories
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import DeploymentUnknown
from kimi_supervisor.opsview.history import HistoryData, RunRecord, dump_history
from kimi_supervisor.opsview.statefile import process_start_time

T0 = 1_795_985_200.0  # 2026-11-29 20:46:40 UTC
NOW = T0 + 900.0


def state_doc(phase: str = "starting", **over: Any) -> dict[str, Any]:
    def worker(pid: int, rank: int, mib: int) -> dict[str, Any]:
        return {
            "pid": pid,
            "ppid": 4102,
            "role": "worker",
            "label": f"Worker_TP{rank}",
            "rank": rank,
            "gpus": [{"index": rank, "used_mib": mib}],
        }

    doc: dict[str, Any] = {
        "schema": 1,
        "supervisor": {
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "version": "0.1.0",
            "config": "/etc/kimi-supervisor/kimi-supervisor.toml",
        },
        "phase": phase,
        "status": "starting: loading weights 68/119 (57%), 4m12s, ~3m10s left",
        "since": T0 + 640,
        "started_at": T0 + 630,
        "spawned_at": T0 + 640,
        "ready_at": None,
        "ended_at": None,
        "exit_code": None,
        "updated_at": NOW - 1,
        "loading": {
            "phase": "loading weights",
            "shards_done": 68,
            "shards_total": 119,
            "percent": 57,
            "elapsed_s": 252.0,
            "eta_s": 190.0,
            "eta_basis": "shard rate",
        },
        "processes": [
            {"pid": 4101, "ppid": 4100, "role": "api_server", "label": "API server", "rank": None, "gpus": []},
            {"pid": 4102, "ppid": 4101, "role": "engine_core", "label": "EngineCore", "rank": None, "gpus": []},
            worker(4110, 0, 41234),
            worker(4111, 1, 41230),
        ],
        "gpus": [
            {"index": 0, "used_mib": 41734, "total_mib": 97887},
            {"index": 1, "used_mib": 41730, "total_mib": 97887},
        ],
        "gpu_error": None,
        "health": {
            "ok": False,
            "latency_s": 0.0003,
            "at": NOW - 2,
            "error": "connection refused",
            "consecutive_failures": 900,
        },
        "canary": {"ok": None, "latency_s": None, "at": None},
        "watchdog": {"enabled": True, "interval_s": 60.0, "last_ping_at": None, "pings": 0},
        "last_failure": {
            "at": T0 + 600,
            "exit_code": 13,
            "root_cause": "vLLM reported a fatal error after it was ready: x",
        },
    }
    doc.update(over)
    return doc


def history() -> HistoryData:
    return HistoryData(
        runs=[
            RunRecord(start=T0 - 7200, pid=10, ready=T0 - 6650, load_s=547.2, end=T0 - 3600, exit_code=0),
            RunRecord(
                start=T0,
                pid=11,
                ready=T0 + 560,
                load_s=555.0,
                end=T0 + 600,
                exit_code=13,
                root_cause="vLLM reported a fatal error after it was ready: x",
            ),
            RunRecord(start=T0 + 630, pid=os.getpid()),
        ],
        counters={"starts_total": 9, "preflight_kills_total": 2, "shm_removed_total": 1},
    )


# The deployment these tests look at: the plain unit's (its config is kimi-supervisor.toml), whose files are
# `<runtime_directory>/kimi-supervisor/state.json` and `<state_directory>/kimi-supervisor/history.json`.
NAME = "kimi-supervisor"


def state_path(tmp_path: Path, name: str = NAME) -> Path:
    return tmp_path / "run" / name / "state.json"


def history_path(tmp_path: Path, name: str = NAME) -> Path:
    return tmp_path / "state" / name / "history.json"


def setup(tmp_path: Path, doc: dict[str, Any] | None, hist: HistoryData | None = None, name: str = NAME) -> Path:
    state_path(tmp_path, name).parent.mkdir(parents=True, exist_ok=True)
    history_path(tmp_path, name).parent.mkdir(parents=True, exist_ok=True)
    if doc is not None:
        state_path(tmp_path, name).write_text(json.dumps(doc))
    if hist is not None:
        history_path(tmp_path, name).write_bytes(dump_history(hist))
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(
        f'[child]\nargv = ["vllm"]\n[paths]\nruntime_directory = "{tmp_path}/run"\n'
        f'state_directory = "{tmp_path}/state"\n'
    )
    return cfg


def paths(tmp_path: Path) -> DeploymentDirectories:
    return layout.of(
        parse_config(
            {
                "child": {"argv": ["vllm"]},
                "paths": {"runtime_directory": f"{tmp_path}/run", "state_directory": f"{tmp_path}/state"},
            },
            tmp_path / f"{NAME}.toml",
        )
    )


# The process tree and GPUs, the same in both reports.
GOLDEN_TREE = """\
    Main PID: {pid} (kimi-supervisor 0.1.0)
      Config: /etc/kimi-supervisor/kimi-supervisor.toml
        Tree: 4101 API server
              └─4102 EngineCore
                ├─4110 Worker_TP0  GPU 0: 41234 MiB
                └─4111 Worker_TP1  GPU 1: 41230 MiB
        GPUs: 0: 41734/97887 MiB, 1: 41730/97887 MiB
"""

GOLDEN_STARTING = (
    """\
● kimi-supervisor - starting: loading weights 68/119 (57%), 4m12s, ~3m10s left
       Phase: starting since 2026-11-29 20:57:20 UTC; 4m20s ago
    Progress: [##############..........] 57% 68/119 shards, 4m12s elapsed, ~3m10s left (shard rate)
"""
    + GOLDEN_TREE
    + """      Health: not answering yet (connection refused), last probe 2s ago
    Watchdog: every 1m00s, no ping yet (pings start at READY)
      Uptime: not ready yet; supervisor up 4m30s
Last failure: exit 13 at 2026-11-29 20:56:40 UTC: vLLM reported a fatal error after it was ready: x

Last 3 runs, newest first (9 starts recorded):
  started (UTC)          load  ended (UTC)          exit  cause
  2026-11-29 20:57:10       -  -                       -  (running)
  2026-11-29 20:46:40   9m15s  2026-11-29 20:56:40    13  vLLM reported a fatal error after it was ready: x
  2026-11-29 18:46:40   9m07s  2026-11-29 19:46:40     0  stopped on request
"""
)

GOLDEN_READY = (
    """\
● kimi-supervisor - ready: serving on http://127.0.0.1:8000 (started in 9m10s)
       Phase: ready since 2026-11-29 21:01:30 UTC; 10s ago
"""
    + GOLDEN_TREE
    + """      Health: ok, 3.2 ms, 1s ago
      Canary: ok, 840 ms, 4s ago
    Watchdog: every 1m00s, last ping 5s ago
      Uptime: ready for 10s, load took 9m10s
"""
)


def test_golden_report_while_loading(tmp_path: Path) -> None:
    setup(tmp_path, state_doc(), history())
    assert render_text(gather(paths(tmp_path)), NOW) == GOLDEN_STARTING.format(pid=os.getpid())


def test_golden_report_when_ready(tmp_path: Path) -> None:
    doc = state_doc(
        "ready",
        status="ready: serving on http://127.0.0.1:8000 (started in 9m10s)",
        since=NOW - 10,
        ready_at=NOW - 10,
        spawned_at=NOW - 560,
        loading=None,
        health={"ok": True, "latency_s": 0.0032, "at": NOW - 1, "error": None, "consecutive_failures": 0},
        canary={"ok": True, "latency_s": 0.84, "at": NOW - 4},
        watchdog={"enabled": True, "interval_s": 60.0, "last_ping_at": NOW - 5, "pings": 1},
        last_failure=None,
    )
    setup(tmp_path, doc, HistoryData())
    assert render_text(gather(paths(tmp_path)), NOW) == GOLDEN_READY.format(pid=os.getpid()) + (
        "\nNo runs recorded yet.\n"
    )


def test_not_running_no_state_file(tmp_path: Path) -> None:
    setup(tmp_path, None)
    snap = gather(paths(tmp_path))
    assert not snap.running
    assert render_text(snap, NOW) == (
        f"○ kimi-supervisor - not running (no state file at {tmp_path}/run/kimi-supervisor/state.json)\n"
        "\nNo runs recorded yet.\n"
    )


def test_not_running_when_the_writer_is_gone_or_its_pid_was_reused(tmp_path: Path) -> None:
    me = os.getpid()
    # Our PID but another start time: a recycled PID, not the supervisor that wrote the file.
    reused = state_doc("ready", supervisor={"pid": me, "start_time": process_start_time(me) - 3600.0})  # type: ignore[operator]
    setup(tmp_path, reused)
    snap = gather(paths(tmp_path))
    assert not snap.running
    assert render_text(snap, NOW).splitlines()[0] == (
        f"○ kimi-supervisor - not running (supervisor PID {me} is gone without a final state (killed?); "
        "it was ready at 2026-11-29 21:01:39 UTC)"
    )
    stopped = state_doc("failed", supervisor={"pid": me, "start_time": 1.0}, ended_at=T0 + 600, exit_code=13)
    setup(tmp_path, stopped)
    assert render_text(gather(paths(tmp_path)), NOW).splitlines()[:2] == [
        "× kimi-supervisor - not running (failed at 2026-11-29 20:56:40 UTC, exit 13)",
        "Last failure: exit 13 at 2026-11-29 20:56:40 UTC: vLLM reported a fatal error after it was ready: x",
    ]


def test_json_and_exit_codes(tmp_path: Path) -> None:
    cfg = setup(tmp_path, state_doc(), history())
    out = io.StringIO()
    assert run_status(cfg, as_json=True, watch=False, out=out) == 0
    # One shape always, for one deployment too: an array of deployment objects (docs/operators-view.md).
    [data] = json.loads(out.getvalue())
    assert set(data) == {
        "deployment",
        "running",
        "reason",
        "state_file",
        "state",
        "history_file",
        "counters",
        "runs",
        "note",
    }
    assert data["running"] is True and data["state"]["loading"]["eta_s"] == 190.0
    assert [r["pid"] for r in data["runs"]] == [os.getpid(), 11, 10]  # newest first
    state_path(tmp_path).unlink()
    assert run_status(cfg, as_json=True, watch=False, out=io.StringIO()) == 3


def test_corrupt_state_or_history_is_reported_not_raised(tmp_path: Path) -> None:
    setup(tmp_path, None)
    state_path(tmp_path).write_text("{half")
    history_path(tmp_path).write_text("[]")
    text = render_text(gather(paths(tmp_path)), NOW)
    assert text.startswith("○ kimi-supervisor - not running (state file unreadable)")
    assert "Note: history corrupt: not a schema-1 history document; state file unreadable: " in text
    assert history_path(tmp_path).exists()  # a reader never moves the daemon's file


def test_colours_only_on_a_terminal(tmp_path: Path) -> None:
    cfg = setup(tmp_path, state_doc(), history())
    pipe = io.StringIO()
    run_status(cfg, as_json=False, watch=False, out=pipe)
    assert "\x1b[" not in pipe.getvalue()
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        run_status(cfg, as_json=False, watch=False, out=tty)
    shown = os.read(master, 65536).decode()
    os.close(master)
    assert "\x1b[33m●\x1b[0m kimi-supervisor" in shown and "\x1b[31mexit 13" in shown


@pytest.mark.parametrize("final", ["ready", "gone"])
def test_watch_refreshes_every_second_until_ready(tmp_path: Path, final: str) -> None:
    cfg = setup(tmp_path, state_doc(), history())
    state = state_path(tmp_path)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            if final == "ready":
                state.write_text(json.dumps(state_doc("ready", status="ready: serving", loading=None)))
            else:
                state.unlink()

    out = io.StringIO()
    rc = run_status(cfg, as_json=False, watch=True, out=out, sleep=sleep)
    assert slept == [1.0, 1.0]
    reports = out.getvalue().split("\n\n● ")
    assert rc == (0 if final == "ready" else 3)
    assert out.getvalue().count("kimi-supervisor - starting: loading weights") == 2
    assert len(reports) == (3 if final == "ready" else 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_non_root_user_can_read_what_the_daemon_wrote(tmp_path: Path) -> None:
    from kimi_supervisor.opsview.history import History
    from kimi_supervisor.opsview.statefile import StateFile
    from testkit.fakes.log import RecordingLog

    base = Path(tempfile.mkdtemp(prefix="kimi-status-"))  # tmp_path's parents are 0700: nobody could reach it
    try:
        base.chmod(0o755)
        dirs = {"runtime_directory": f"{base}/run", "state_directory": f"{base}/state"}
        cfg = parse_config({"child": {"argv": ["vllm"]}, "paths": dirs}, base / "k.toml")
        own = layout.of(cfg)
        old = os.umask(0o077)  # the unit's UMask=
        try:
            StateFile(own.runtime, RecordingLog()).write(state_doc())
            History(own.state / "history.json", RecordingLog(), pid=1).begin(T0)
        finally:
            os.umask(old)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                snap = gather(own)
                os.write(write, f"{snap.running} {snap.note} {len(snap.history.runs)}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(read, 1000).decode() == "True None 1"
        os.close(read)
    finally:
        shutil.rmtree(base)


# -- several deployments on one host (docs/configuration.md) -------------------------------------------


def deployment(tmp_path: Path, name: str, doc: dict[str, Any] | None, hist: HistoryData | None = None) -> Path:
    """Deployment NAME's config in tmp_path/etc (the host's /etc/kimi-supervisor), with the default-like
    shared [paths] every deployment of a host has: their files differ only by the name below them."""
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    setup(tmp_path, doc, hist, name=name)
    return (tmp_path / f"{name}.toml").rename(etc / f"{name}.toml")


def test_several_deployments_are_listed_one_line_each(tmp_path: Path) -> None:
    me = os.getpid()
    a = state_doc("ready", status="ready: serving on http://127.0.0.1:18555 (load 9m07s)")
    gone = state_doc("failed", supervisor={"pid": me, "start_time": 1.0}, ended_at=T0 + 600, exit_code=18)
    deployment(tmp_path, "kimi-a", a)
    deployment(tmp_path, "kimi-b", gone)
    out = io.StringIO()
    rc = run_status(None, False, False, out=out, config_dir=tmp_path / "etc")
    assert out.getvalue() == (
        f"● kimi-a                   ready: serving on http://127.0.0.1:18555 (load 9m07s) (PID {me})\n"
        "× kimi-b                   not running (failed at 2026-11-29 20:56:40 UTC, exit 18)\n"
    )
    assert rc == 3  # not every one runs
    out = io.StringIO()
    assert run_status(None, True, False, out=out, config_dir=tmp_path / "etc") == 3
    listed = json.loads(out.getvalue())
    assert [(d["deployment"], d["running"], d["state_file"]) for d in listed] == [
        ("kimi-a", True, str(state_path(tmp_path, "kimi-a"))),
        ("kimi-b", False, str(state_path(tmp_path, "kimi-b"))),
    ]


def test_status_name_shows_that_deployment_only(tmp_path: Path) -> None:
    a = state_doc("ready", status="ready: serving on http://127.0.0.1:18555")
    b = state_doc("ready", status="ready: serving on http://127.0.0.1:18556")
    deployment(tmp_path, "kimi-a", a, history())
    deployment(tmp_path, "kimi-b", b, HistoryData())
    out = io.StringIO()
    assert run_status(None, False, False, out=out, name="kimi-b", config_dir=tmp_path / "etc") == 0
    text = out.getvalue()
    assert text.startswith("● kimi-supervisor@kimi-b - ready: serving on http://127.0.0.1:18556\n")
    assert "18555" not in text and "No runs recorded yet." in text  # a's history is a's
    unknown = r"status: no deployment named 'kimi-c' in .* \(configured: kimi-a, kimi-b\)"
    with pytest.raises(DeploymentUnknown, match=unknown) as raised:
        run_status(None, False, False, out=io.StringIO(), name="kimi-c", config_dir=tmp_path / "etc")
    assert raised.value.exit_code == 4  # LSB's "status unknown", not 78: no config is wrong


def test_one_deployment_on_the_host_shows_in_full_without_config(tmp_path: Path) -> None:
    deployment(tmp_path, NAME, state_doc(), history())
    out = io.StringIO()
    assert run_status(None, False, False, out=out, now=lambda: NOW, config_dir=tmp_path / "etc") == 0
    assert out.getvalue() == render_text(gather(paths(tmp_path)), NOW)


def test_deployments_without_a_config_here_are_found_by_their_state_files(tmp_path: Path) -> None:
    """docs/configuration.md: one started from a config elsewhere (kimi-b, config in /srv) and one whose config is gone
    (kimi-c) show beside the configured kimi-a, running or not, instead of "not running", exit 3."""
    me = os.getpid()
    deployment(tmp_path, "kimi-a", state_doc("ready", status="ready: serving on http://127.0.0.1:18555"))
    srv = tmp_path / "srv"
    srv.mkdir()
    b_config = setup(tmp_path, None, history(), name="kimi-b").rename(srv / "kimi-b.toml")
    b = state_doc("ready", status="ready: serving on http://127.0.0.1:18556")
    b["supervisor"]["config"] = str(b_config)
    state_path(tmp_path, "kimi-b").write_text(json.dumps(b))
    c = state_doc("failed", supervisor={"pid": me, "start_time": 1.0, "config": str(srv / "gone.toml")})
    setup(tmp_path, c | {"ended_at": T0 + 600, "exit_code": 13}, name="kimi-c").unlink()
    out = io.StringIO()
    assert run_status(None, False, False, out=out, config_dir=tmp_path / "etc") == 3
    assert out.getvalue() == (
        f"● kimi-a                   ready: serving on http://127.0.0.1:18555 (PID {me})\n"
        f"● kimi-b                   ready: serving on http://127.0.0.1:18556 (PID {me})\n"
        "× kimi-c                   not running (failed at 2026-11-29 20:56:40 UTC, exit 13)\n"
    )
    out = io.StringIO()
    assert run_status(None, True, False, out=out, name="kimi-b", config_dir=tmp_path / "etc") == 0
    [shown] = json.loads(out.getvalue())
    # kimi-b's history comes from the directories its own config names, not a default.
    assert shown["history_file"] == str(history_path(tmp_path, "kimi-b")) and len(shown["runs"]) == len(history().runs)
    # A runtime directory given outright (the host's /run/kimi-supervisor for the CLI) is searched too.
    alone = tmp_path / "alone"
    (alone / "kimi-d").mkdir(parents=True)
    (alone / "kimi-d" / "state.json").write_text(json.dumps(state_doc("ready", status="ready: d")))
    out = io.StringIO()
    assert run_status(None, False, False, out=out, config_dir=tmp_path / "none", runtime_dirs=(alone,)) == 0
    assert (
        out.getvalue().startswith("● kimi-supervisor@kimi-d - ready: d\n") and "No runs recorded yet." in out.getvalue()
    )


def test_status_of_an_unknown_name_exits_4_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kimi-supervisor status NOSUCH`: exit 4 (LSB "program or service status is unknown") and one line on
    stderr naming the deployments there are; the host's directories and processes are swapped for the test's."""
    from kimi_supervisor import cli
    from kimi_supervisor.cli import status

    deployment(tmp_path, "kimi-a", state_doc())
    real = status.run_status

    def on_test_dirs(*args: Any, **kwargs: Any) -> int:
        return real(*args, **{**kwargs, "config_dir": tmp_path / "etc", "runtime_dirs": (), "running": tuple})

    monkeypatch.setattr(status, "run_status", on_test_dirs)
    assert cli.main(["status", "NOSUCH"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no deployment named 'NOSUCH'" in err and "configured: kimi-a" in err, err
