"""The state file's checks on what an engine reads from its holder's (docs/weight-holder.md): the checkpoint record."""

from __future__ import annotations

from typing import Any

import pytest

from kimi_supervisor.opsview.statefile import validate_state
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
