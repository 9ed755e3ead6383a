"""docs/weight-holder.md: the engine waits for its deployment's holder, is refused on another cache key, and gives up
with exit 21 (nothing killed) when the holder is not ready in time.  Real supervisors around the fake vLLM."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config import layout
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ExitCode, PreflightError
from kimi_supervisor.host.checkpoint import fingerprint
from kimi_supervisor.lifecycle.holderwait import look
from kimi_supervisor.opsview.statefile import SCHEMA
from testkit.harness import REPO, Run, fake_tree_of, weights_pair
from testkit.safetensors_files import write_model, write_shard
from tests.conftest import wait_for


def own(tmp_path: Path, name: str) -> Path:
    """A directory for one supervisor's notify socket."""
    (tmp_path / name).mkdir(exist_ok=True)
    return tmp_path / name


def test_engine_waits_for_the_holder_then_maps_it_and_restarts_without_it(tmp_path: Path) -> None:
    holder_cfg, engine_cfg = weights_pair(tmp_path)
    engine = Run(engine_cfg, own(tmp_path, "e"))
    holder = None
    try:
        waiting = engine.wait_event("weights.waiting", timeout=20)
        assert "no weight holder" in waiting["why"] and engine.event("state.starting") is None
        holder = Run(holder_cfg, own(tmp_path, "h"))
        holder.wait_event("state.ready", timeout=30)
        state_file = tmp_path / "run" / "kimi" / "state.weights.json"
        # The state file follows the event (written atomically, never ahead of what happened).
        wait_for(lambda: json.loads(state_file.read_text())["phase"] == "ready", timeout=10)
        state = json.loads(state_file.read_text())
        assert state["weights"]["role"] == "holder"
        assert state["weights"]["key"]["tensor_parallel_size"] == "2"
        assert (tmp_path / "state" / "kimi" / "history.weights.json").exists()
        assert engine.wait_event("weights.holder_ready", timeout=20)["why"].startswith("ready (supervisor PID")
        engine.wait_event("state.ready", timeout=30)
        # The engine's stop leaves the holder serving: a restart maps the weights again.
        engine.signal()
        assert engine.wait(20) == ExitCode.OK
        assert holder.proc.poll() is None and fake_tree_of(f"{tmp_path}/holder")
        again = Run(engine_cfg, own(tmp_path, "e2"))
        try:
            again.wait_event("state.ready", timeout=30)
        finally:
            again.signal()
            again.wait(20)
    finally:
        engine.kill()
        if holder is not None:
            holder.signal()
            holder.wait(20)


def test_holder_not_ready_in_time_is_exit_21_and_nothing_killed(tmp_path: Path) -> None:
    holder_cfg, engine_cfg = weights_pair(tmp_path, holder_args=["--never-ready"], wait_s=1.5)
    holder = Run(holder_cfg, own(tmp_path, "h"))
    try:
        holder.wait_event("state.starting", timeout=20)
        engine = Run(engine_cfg, own(tmp_path, "e"))
        assert engine.wait(30) == ExitCode.WEIGHTS_UNAVAILABLE
        exit_event = engine.event("supervisor.exit")
        assert exit_event is not None and "\n" not in exit_event["error"]
        assert exit_event["error"].startswith(
            "the weight holder of deployment kimi was not ready within 1.5s (weights.wait_s): the holder is starting"
        )
        assert exit_event["error"].endswith("; nothing was killed")
        assert engine.event("state.starting") is None  # no engine spawned
        assert holder.proc.poll() is None and fake_tree_of(f"{tmp_path}/holder")  # the holder untouched
    finally:
        holder.signal()
        holder.wait(20)


def test_engine_whose_flags_differ_from_the_holders_key_is_refused_naming_them(tmp_path: Path) -> None:
    holder_cfg, engine_cfg = weights_pair(tmp_path, holder_args=["--dtype", "bfloat16"])
    holder = Run(holder_cfg, own(tmp_path, "h"))
    try:
        holder.wait_event("state.ready", timeout=30)
        engine = Run(engine_cfg, own(tmp_path, "e"))
        assert engine.wait(30) == ExitCode.PREFLIGHT_FAILED
        exit_event = engine.event("supervisor.exit")
        assert exit_event is not None
        assert exit_event["error"].startswith(
            "weights: the engine's flags do not match its weight holder's cache key (dtype: holder 'bfloat16', "
            "engine 'auto'): start the holder (kimi-supervisor-weights@kimi.service) with the engine's flags"
        )
        assert holder.proc.poll() is None
    finally:
        holder.signal()
        holder.wait(20)


def test_a_model_changed_under_a_live_holder_refuses_the_engine_naming_the_shard(tmp_path: Path) -> None:
    """The holder records the checkpoint it loads (vLLM's fingerprint); an engine whose model on disk has since
    changed is refused with exit 10 naming the shard, before vLLM's own key check would fail its load."""
    shards = write_model(tmp_path / "model")
    holder_cfg, engine_cfg = weights_pair(tmp_path)
    holder = Run(holder_cfg, own(tmp_path, "h"))
    try:
        holder.wait_event("state.ready", timeout=30)
        state = json.loads((tmp_path / "run" / "kimi" / "state.weights.json").read_text())
        held = fingerprint(tmp_path / "model")
        assert held is not None and state["weights"]["checkpoint"] == held.to_doc()
        engine = Run(engine_cfg, own(tmp_path, "e"))  # the same checkpoint: it starts
        engine.wait_event("state.ready", timeout=30)
        engine.signal()
        assert engine.wait(20) == ExitCode.OK
        write_shard(shards[1], {"layers.2.w": ("BF16", [8, 16]), "layers.2.b": ("F32", [8])})  # a new checkpoint
        engine = Run(engine_cfg, own(tmp_path, "e2"))
        assert engine.wait(30) == ExitCode.PREFLIGHT_FAILED
        exit_event = engine.event("supervisor.exit")
        assert exit_event is not None and exit_event["error"] == (
            "weights: the model on disk is not the checkpoint its weight holder loaded (header changed: "
            "model-00002-of-00003.safetensors): vLLM would refuse the held weights; restart "
            "kimi-supervisor-weights@kimi.service (a full load), then the engine"
        )
        assert engine.event("state.starting") is None  # nothing spawned
        assert holder.proc.poll() is None and fake_tree_of(f"{tmp_path}/holder")  # the holder untouched
    finally:
        holder.signal()
        holder.wait(20)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


def test_dry_run_and_status_show_the_holder(tmp_path: Path) -> None:
    holder_cfg, engine_cfg = weights_pair(tmp_path, wait_s=7)
    # No holder yet: the engine's dry run says a start would wait, then exit 21; on CPU, that vLLM's daemon refuses.
    result = cli("--config", str(engine_cfg), "--dry-run")
    assert result.returncode == ExitCode.PREFLIGHT_FAILED, result.stdout + result.stderr
    assert "a start would wait up to 7s (weights.wait_s) for the weight holder, then exit 21: no weight holder" in (
        result.stdout
    )
    refuses = "no GPU here: the real `vllm preload` refuses without CUDA IPC (check_ipc_platform_support)"
    assert [line for line in result.stdout.splitlines() if refuses in line] != []
    result = cli("--config", str(holder_cfg), "--dry-run")
    sockets = load_config(holder_cfg).weights.socket_dir  # type: ignore[union-attr]
    assert "weight holder: sockets in " + str(sockets) in result.stdout
    assert "checkpoint: not a local checkpoint (vLLM keys on the model's name)" in result.stdout
    write_model(tmp_path / "model")
    fp = fingerprint(tmp_path / "model")
    assert fp is not None
    result = cli("--config", str(holder_cfg), "--dry-run")
    assert f"checkpoint: 3 shard header(s), vLLM fingerprint {fp.digest[:12]}" in result.stdout, result.stdout
    assert refuses in result.stdout
    holder = Run(holder_cfg, own(tmp_path, "h"))
    engine = None
    try:
        holder.wait_event("state.ready", timeout=30)
        result = cli("--config", str(engine_cfg), "--dry-run")
        assert "weight holder ready (supervisor PID" in result.stdout and result.returncode == 0, result.stdout
        engine = Run(engine_cfg, own(tmp_path, "e"))
        engine.wait_event("state.ready", timeout=30)
        status = cli("status", "--config", str(engine_cfg))
        assert status.returncode == 0, status.stderr
        assert "kimi-supervisor-weights@kimi - " in status.stdout
        weights_line = next(line for line in status.stdout.splitlines() if line.strip().startswith("Weights:"))
        assert "holder ready, ready for " in weights_line and "1 engine load(s) served" in weights_line
        [doc] = json.loads(cli("status", "--config", str(engine_cfg), "--json").stdout)
        assert doc["weights_holder"]["summary"]["loads_served"] == 1
        assert doc["weights_holder"]["state"]["weights"]["role"] == "holder"
    finally:
        if engine is not None:
            engine.signal()
            engine.wait(20)
        holder.signal()
        holder.wait(20)


def test_the_holders_stop_drains_nothing(tmp_path: Path) -> None:
    """The holder serves no request and has no /metrics: its stop is SIGTERM and the tree's exit, no drain."""
    holder_cfg, _ = weights_pair(tmp_path)
    holder = Run(holder_cfg, own(tmp_path, "h"))
    try:
        holder.wait_event("state.ready", timeout=30)
    finally:
        holder.signal()
        rc = holder.wait(20)
    assert rc == ExitCode.OK
    assert holder.event("stop.tree_gone") is not None
    assert holder.event("stop.drain") is None and holder.event("stop.metrics_unavailable") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_holder_with_a_child_user_starts_and_an_engine_of_another_user_is_refused(open_dir: Path) -> None:
    """Was (docs/weight-holder.md): `vllm preload` as `child.user` could not make its socket directory in
    root's 0755 <runtime>/<name> (EACCES, exit 11 on every start).  The supervisor makes it for that user before
    the spawn and records the uid; an engine whose child runs as another account is refused (exit 10)."""
    nobody = pwd.getpwnam("nobody").pw_uid
    # The system python: nobody cannot enter /root, where the test's interpreter may live.
    holder_cfg, engine_cfg = weights_pair(open_dir, holder_user="nobody", python="/usr/bin/python3")
    holder = Run(holder_cfg, own(open_dir, "h"))
    try:
        made = holder.wait_event("weights.socket_dir", timeout=30)
        sockets = layout.of(load_config(holder_cfg)).runtime / "weight-cache"
        assert made["path"] == str(sockets) and made["uid"] == nobody and made["made"] is True
        holder.wait_event("state.ready", timeout=60)
        st = sockets.lstat()
        assert st.st_uid == nobody and stat.S_IMODE(st.st_mode) == 0o700
        state_file = layout.of(load_config(holder_cfg)).state_file
        weights = json.loads(state_file.read_text())["weights"]
        assert weights["child_uid"] == nobody and weights["child_user"] == "nobody"
        engine = Run(engine_cfg, own(open_dir, "e"))  # its child runs as root
        assert engine.wait(30) == ExitCode.PREFLIGHT_FAILED
        exit_event = engine.event("supervisor.exit")
        assert exit_event is not None and exit_event["error"] == (
            "weights: the engine's child runs as user 'root' (uid 0) but its weight holder's "
            f"(kimi-supervisor-weights@kimi.service) as user 'nobody' (uid {nobody}): vLLM maps held weights only "
            "between processes of one account; give both configs the same child.user"
        )
        assert engine.event("state.starting") is None and holder.proc.poll() is None
    finally:
        holder.signal()
        holder.wait(20)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_symlink_at_the_holders_socket_directory_is_refused_and_never_followed(tmp_path: Path) -> None:
    holder_cfg, _ = weights_pair(tmp_path, holder_user="nobody", python="/usr/bin/python3")
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    runtime = layout.of(load_config(holder_cfg)).runtime
    runtime.mkdir(parents=True)
    (runtime / "weight-cache").symlink_to(victim)
    holder = Run(holder_cfg, own(tmp_path, "h"))
    assert holder.wait(30) == ExitCode.CONFIG
    said = [line for line in holder.raw_stderr if line.startswith("kimi-supervisor: config error: ")]
    assert said == [
        f"kimi-supervisor: config error: weight holder socket directory {runtime}/weight-cache is a "
        "symbolic link; remove it (it is not ours to follow)"
    ], holder.raw_stderr
    assert victim.stat().st_uid == 0 and holder.event("state.starting") is None


def test_the_holders_dry_run_says_what_it_would_create_and_creates_nothing(tmp_path: Path) -> None:
    holder_cfg, _ = weights_pair(tmp_path)
    result = cli("--config", str(holder_cfg), "--dry-run")
    runtime = layout.of(load_config(holder_cfg)).runtime
    assert f"{runtime / 'weight-cache'}: a start would create it, 0700, owned by user " in result.stdout, result.stdout
    # weights_pair made the (linked) runtime directory itself; the dry run adds nothing inside it.
    assert not runtime.exists() and list(runtime.parent.iterdir()) == []


def test_an_engine_of_another_account_than_the_holders_is_refused_naming_both(tmp_path: Path) -> None:
    """vLLM's engine takes only sockets its own uid owns and the daemon only peers of its uid (SO_PEERCRED):
    an engine of another account would fail after its whole start.  Refused at once, exit 10."""
    _, engine_cfg = weights_pair(tmp_path)
    cfg = load_config(engine_cfg)
    assert cfg.weights is not None
    other = 65534 if os.geteuid() != 65534 else 65533
    me = pwd.getpwuid(os.geteuid()).pw_name
    state = layout.holder_of(cfg).state_file
    state.parent.mkdir(parents=True)
    holder = {"role": "holder", "key": dict(cfg.weights.key), "health_url": "http://127.0.0.1:9/health"}
    doc = {"schema": SCHEMA, "phase": "starting", "supervisor": {"pid": os.getpid()}}
    state.write_text(json.dumps({**doc, "weights": {**holder, "child_uid": other, "child_user": "holders"}}))
    with pytest.raises(PreflightError) as info:
        look(cfg, alive=lambda doc: True)
    assert info.value.exit_code == ExitCode.PREFLIGHT_FAILED
    assert info.value.message == (
        f"weights: the engine's child runs as user {me!r} (uid {os.geteuid()}) but its weight holder's "
        f"(kimi-supervisor-weights@kimi.service) as user 'holders' (uid {other}): vLLM maps held weights only "
        "between processes of one account; give both configs the same child.user"
    )
    # The same account, or a holder from before the uid was recorded: no refusal, the engine waits for it.
    for weights in ({**holder, "child_uid": os.geteuid(), "child_user": me}, holder):
        state.write_text(json.dumps({**doc, "weights": weights}))
        assert look(cfg, alive=lambda doc: True).why == "the holder is starting: no status"
