"""Issue 26: the engine waits for its deployment's weight holder, is refused on another cache key, and gives up
with exit 21 (nothing killed) when the holder is not ready in time.  Real supervisors around the fake vLLM."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_supervisor.exitcodes import ExitCode
from testkit.harness import Run, fake_tree_of, weights_pair


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
        state = json.loads((tmp_path / "run" / "kimi" / "state.weights.json").read_text())
        assert state["phase"] == "ready" and state["weights"]["role"] == "holder"
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
