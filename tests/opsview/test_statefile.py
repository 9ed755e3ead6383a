"""The state file's checks on what an engine reads from its holder's (docs/weight-holder.md): the checkpoint record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from kimi_supervisor.opsview.statefile import process_start_time, read_live_state, validate_state, writer_alive
from kimi_supervisor.untrusted_json import Untrusted


def doc(checkpoint: object) -> dict[str, Any]:
    return {"supervisor": {"pid": 10}, "weights": {"role": "holder", "checkpoint": checkpoint}}


def test_a_holders_checkpoint_record_is_accepted() -> None:
    validate_state(doc({"digest": "ab" * 16, "shards": {f"model-{i:05d}.safetensors": "cd" * 16 for i in range(119)}}))
    validate_state(doc(None))  # an unreadable checkpoint is recorded as unknown


@pytest.mark.parametrize(
    "checkpoint, where",
    [
        ("abc", "weights.checkpoint: expected an object"),
        ({"digest": 7, "shards": {}}, "weights.checkpoint.digest"),
        ({"shards": {}}, "weights.checkpoint.digest"),
        ({"digest": "ab", "shards": ["x"]}, "weights.checkpoint.shards: expected an object"),
        ({"digest": "ab", "shards": {"a.safetensors": None}}, "weights.checkpoint.shards.a.safetensors"),
        ({"digest": "ab", "shards": {"a.safetensors": "f" * 129}}, "weights.checkpoint.shards.a.safetensors"),
    ],
)
def test_a_wrong_checkpoint_record_is_refused_naming_the_field(checkpoint: object, where: str) -> None:
    with pytest.raises(Untrusted, match=where.replace(".", r"\.")):
        validate_state(doc(checkpoint))


def test_the_writer_is_alive_only_while_its_pid_names_the_process_that_wrote_it() -> None:
    """`status` and an engine waiting on its holder ask whether a state file's writer still runs. In a
    container's small PID namespace a process started a fraction of a second after the writer can hold its PID
    (a restarted unit's supervisor): that is another process, as it is for every kill (host/procident.py)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = psutil.Process(proc.pid).create_time()
        assert writer_alive({"supervisor": {"pid": proc.pid, "start_time": started}})
        for off_by in (0.3, -0.3, 0.02):
            writer = {"supervisor": {"pid": proc.pid, "start_time": started + off_by}}
            assert not writer_alive(writer), f"a process started {off_by:+} s from the writer counted as it"
    finally:
        proc.kill()
        proc.wait()


def test_a_state_file_is_read_live_only_while_its_writer_runs(tmp_path: Path) -> None:
    """read_live_state, the one "read it, keep it if its writer is alive" (the front reads its engine's and its
    weight holder's through it): a gone writer's file, a missing one and a broken one are all None."""
    path = tmp_path / "state.json"
    assert read_live_state(path) is None
    started = process_start_time(os.getpid())
    assert started is not None
    for start_time, expected in ((started, "stopping"), (started - 100, None)):
        writer = {"pid": os.getpid(), "start_time": start_time, "version": "t", "config": ""}
        path.write_text(json.dumps({"schema": 1, "supervisor": writer, "phase": "stopping"}))
        live = read_live_state(path)
        assert (live or {}).get("phase") == expected
    path.write_text('{"schema": 1, "supervisor": {"pid": "x"}}')
    assert read_live_state(path) is None
