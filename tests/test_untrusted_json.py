"""untrusted_json.parse_json, the one parser of JSON from outside, and every reader that goes through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.config.weights import weights_key
from kimi_supervisor.deployment.group import view
from kimi_supervisor.host.instance_lock import Resource, _owner
from kimi_supervisor.liveness.http import Answer
from kimi_supervisor.untrusted_json import Untrusted, parse_json

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (DEEP, "JSON nested too deeply"),
        (b'{"choices": NaN}', "not JSON: NaN"),
        (b'{"n": -Infinity}', "not JSON: -Infinity"),
        (b'{"n": 1e400}', "number 1e400 is not finite"),
        (b"\xff\xfe", "not UTF-8: invalid start byte at byte 0"),
        (b'{"a": ', "not JSON: Expecting value at line 1 column 7"),
        (
            b"1" * 5000,
            "not JSON: Exceeds the limit (4300 digits) for integer string conversion",
        ),
    ],
)
def test_parse_json_raises_only_untrusted_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(Untrusted) as info:
        parse_json(data)
    assert str(info.value).startswith(reason)


def test_a_readers_depth_limit_is_counted_before_the_parser_runs() -> None:
    assert parse_json(b'{"a": [[1]], "b": "[[[[[["}', max_depth=3) == {"a": [[1]], "b": "[[[[[["}
    with pytest.raises(Untrusted, match=r"^nested deeper than 3 levels$"):
        parse_json(b'{"a": [[[1]]]}', max_depth=3)


def test_every_reader_of_json_from_outside_survives_a_100k_deep_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each read json.loads directly: RecursionError is no ValueError, so it went past their `except ValueError`.
    # `status` on a group node, against whatever answers on this node's status port:
    monkeypatch.setattr(view, "request", lambda *a, **k: Answer(200, DEEP, None, 0.0, 0.0))
    assert view.fetch(ClusterConfig(2, 0, "10.77.0.1", 29771)) == (None, "JSON nested too deeply")
    # An instance lock's record, in a directory other accounts' lock files share:
    (tmp_path / "gpu-0.lock").write_bytes(DEEP)
    owner = _owner(tmp_path, Resource("GPU 0", "gpu-0.lock"), {4242})
    assert (owner.pid, owner.gpus, owner.port) == (4242, None, None)
    # A model's config.json, for the weight-cache key's `--dtype auto`:
    model = tmp_path / "model"
    model.mkdir()
    plain = weights_key(["vllm", "serve", str(model)])
    (model / "config.json").write_bytes(DEEP)
    assert weights_key(["vllm", "serve", str(model)]) == plain
