"""The state file's checks on what an engine reads from its holder's (docs/weight-holder.md): the checkpoint record."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import psutil
import pytest

from kimi_supervisor.opsview.statefile import validate_state, writer_alive
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
