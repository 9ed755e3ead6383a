"""Which kind of restart each outage was (docs/front.md, "Metrics and status"): the front's outage window joined
with its engine's history (how each run ended) and its weight holder's state file; in the state file's outages,
`status`'s Front line and `kimi_front_outages_ended_total{kind}`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kimi_supervisor import __version__
from kimi_supervisor.cli.status import Snapshot, render_front
from kimi_supervisor.opsview.history import HistoryData, RunRecord, dump_history
from kimi_supervisor.opsview.statefile import StateFile, process_start_time
from kimi_supervisor.roles import Role
from testkit.fakes.log import RecordingLog
from tests.deployment.front.harness import run, running, until


def _holder_ready(path: Path, ready_at: float) -> None:
    """A weight holder's state file as its supervisor writes it, this process standing in as the live writer."""
    pid = os.getpid()
    now = time.time()
    doc = {
        "schema": 1,
        "supervisor": {"pid": pid, "start_time": process_start_time(pid), "version": __version__, "config": ""},
        "phase": "ready",
        "status": "ready",
        "since": ready_at,
        "started_at": ready_at - 60,
        "ready_at": ready_at,
        "updated_at": now,
        "ended_at": None,
        "exit_code": None,
    }
    assert StateFile(path.parent, RecordingLog(), path.name).write(doc)


@pytest.mark.parametrize(
    ("exit_code", "holder", "kind"),
    [(0, False, "planned"), (0, True, "planned"), (13, False, "crash"), (14, True, "unhealthy"), (None, False, None)],
)
def test_an_outage_is_named_by_how_the_engines_run_ended(
    tmp_path: Path, exit_code: int | None, holder: bool, kind: str | None
) -> None:
    """exit_code None: the engine was unreachable and came back without any run of it ending ("no restart")."""
    history, holder_state = tmp_path / "history.json", tmp_path / "state.weights.json"
    history.write_bytes(dump_history(HistoryData([RunRecord(start=time.time() - 100, pid=1, ready=1.0, load_s=9)])))

    async def scenario() -> None:
        async with running(engine_history_file=history, engine_holder_state_file=holder_state) as h:
            await h.engine.crash()
            await until(lambda: not h.front.engines.serving, "the outage")
            [outage] = h.front.metrics.outages_seen
            began = float(outage["began"] or 0)
            if exit_code is not None:  # the engine's supervisor records how its run ended; a new run starts
                ended = RunRecord(start=began - 100, pid=1, ready=began - 90, load_s=10, end=time.time())
                ended.exit_code = exit_code
                history.write_bytes(dump_history(HistoryData([ended, RunRecord(start=time.time(), pid=2)])))
            if holder:
                _holder_ready(holder_state, began - 50)
            await h.engine.restart()
            await until(lambda: h.front.engines.serving, "the engine back")
            [outage] = h.front.metrics.outages_seen
            expected = kind if kind is not None else "no restart"
            assert (outage["kind"], outage["engine_exit_code"], outage["holder_assisted"]) == (
                expected,
                exit_code,
                holder,
            )
            metrics = h.front.metrics.text().decode()
            assert f'kimi_front_outages_ended_total{{deployment="kimi-supervisor",kind="{expected}"}} 1.0' in metrics
            snap = Snapshot(
                "kimi", True, "PID 7", {"phase": "ready", "front": {"engine_serving": True, "held": 0,
                "outages": [outage]}}, Path("s"), HistoryData(), Path("h"), None, Role.FRONT,
            )  # fmt: skip
            line = render_front(snap, time.time())
            assert f"the last {float(outage['ended'] or 0) - began:.1f}s ({expected}" in line
            assert (", holder-assisted)" in line) is holder

    run(scenario)


def test_without_the_engines_history_the_kind_is_unknown(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running(engine_history_file=tmp_path / "none.json") as h:
            await h.engine.crash()
            await until(lambda: not h.front.engines.serving, "the outage")
            await h.engine.restart()
            await until(lambda: h.front.engines.serving, "the engine back")
            assert [o["kind"] for o in h.front.metrics.outages_seen] == ["unknown"]

    run(scenario)
