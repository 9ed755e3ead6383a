"""docs/weight-holder.md: the fake `vllm preload` has the real daemon's shape (testkit/fakes/fake_vllm_preload.py, each
behaviour with its vLLM source line), and the supervisor copes with it: silent spawn-child ranks, exit 241 on
SIGTERM, ranks that outlive a SIGKILLed parent."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from kimi_supervisor.exitcodes import ExitCode
from testkit.harness import Run, fake_tree_of, weights_pair
from tests.conftest import wait_for


def own(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir(exist_ok=True)
    return tmp_path / name


def ranks_of(tmp_path: Path) -> list[psutil.Process]:
    return [p for p in fake_tree_of(f"{tmp_path}/holder") if "spawn_main" in " ".join(p.cmdline())]


def ready_holder(tmp_path: Path) -> tuple[Run, int, list[psutil.Process]]:
    """A holder's supervisor around the fake `vllm preload` -tp 2, READY: (it, its child's PID, the 2 ranks)."""
    holder_cfg, _ = weights_pair(tmp_path, tp=2)
    holder = Run(holder_cfg, own(tmp_path, "h"))
    try:
        holder.wait_event("state.ready", timeout=60)
        ranks = ranks_of(tmp_path)
        assert len(ranks) == 2 and {r.ppid() for r in ranks} == {holder.child_pid}
    except BaseException:
        holder.kill()
        raise
    return holder, holder.child_pid, ranks


def test_holder_ranks_are_silent_spawn_children_and_a_term_stop_is_clean(tmp_path: Path) -> None:
    holder, _, ranks = ready_holder(tmp_path)
    try:
        # No vLLM title: `python3 -c from multiprocessing.spawn import spawn_main; ...` (preload.py:239).
        assert all("vllm-weight-cache" not in " ".join(r.cmdline()) + r.name() for r in ranks)
        holder.signal()
        # The parent exits 241 (sys.exit(-15), preload.py:337): the supervisor's stop on request is still clean.
        assert holder.wait(30) == ExitCode.OK, holder.why()
    finally:
        holder.kill()
    # Only the parent speaks, its launch line and READY: the ranks never set vLLM's logging up.
    lines = [str(r.get("line", "")) for r in holder.child_lines]
    assert [line.split("[")[1].split("]")[0] for line in lines if " INFO " in line] == [
        "preload.py:286",
        "preload.py:321",
    ], lines


def test_ranks_outliving_a_sigkilled_parent_are_stopped_by_the_supervisor(tmp_path: Path) -> None:
    holder, parent, ranks = ready_holder(tmp_path)
    try:
        os.kill(parent, signal.SIGKILL)
        code = holder.wait(60)
        assert code != ExitCode.OK, "the holder's child died: its supervisor must not call that a clean stop"
        # The ranks, reparented to the supervisor (a subreaper), are stopped with the tree, none left behind.
        wait_for(lambda: not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks), timeout=30)
    finally:
        holder.kill()
