"""The load ETA: shard rate once shards load, the last load before that, nothing without a basis."""

from __future__ import annotations

import pytest

from kimi_supervisor.child.readiness import Progress, ReadinessTracker
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.opsview.eta import Estimate, LoadEta
from kimi_supervisor.opsview.history import RunRecord

LAST = RunRecord(start=0.0, pid=1, load_s=540.0, post_weights_s=60.0)


def test_no_history_and_no_shards_gives_no_estimate() -> None:
    eta = LoadEta(None)
    eta.observe(10.0, None, False)
    assert eta.estimate(10.0, 10.0) is None


def test_before_shards_the_last_load_counts_down() -> None:
    eta = LoadEta(LAST)
    eta.observe(100.0, None, False)
    assert eta.estimate(100.0, 40.0) == Estimate(500.0, "last load")
    assert eta.estimate(700.0, 640.0) == Estimate(0.0, "last load")  # overdue: never negative


def test_shard_rate_plus_the_last_loads_tail() -> None:
    eta = LoadEta(LAST)
    eta.observe(0.0, Progress(0, 119, 0), False)
    eta.observe(8.0, Progress(2, 119, 1), False)  # 4 s a shard
    eta.observe(272.0, Progress(68, 119, 57), False)
    est = eta.estimate(272.0, 300.0)
    assert est == Estimate(51 * 4.0 + 60.0, "shard rate")
    # Counted down between progress lines, not frozen.
    assert eta.estimate(282.0, 310.0) == Estimate(51 * 4.0 - 10 + 60.0, "shard rate")


def test_one_shard_is_not_a_rate() -> None:
    eta = LoadEta(None)
    eta.observe(0.0, Progress(0, 10, 0), False)
    eta.observe(5.0, Progress(1, 10, 10), False)
    assert eta.estimate(5.0, 5.0) is None


def test_after_the_weights_only_the_tail_is_left() -> None:
    eta = LoadEta(LAST)
    eta.observe(0.0, Progress(0, 4, 0), False)
    eta.observe(10.0, Progress(4, 4, 100), False)
    assert eta.weights_done_at == 10.0
    assert eta.estimate(25.0, 30.0) == Estimate(45.0, "last load")
    assert LoadEta(None).estimate(25.0, 30.0) is None


@pytest.mark.parametrize(("seconds", "text"), [(190.0, "~3m10s left"), (42.4, "~42s left"), (3725.0, "~1h02m left")])
def test_text(seconds: float, text: str) -> None:
    assert Estimate(seconds, "shard rate").text() == text


def test_the_headline_carries_the_eta() -> None:
    cfg = parse_config({"child": {"argv": ["vllm"]}}, __import__("pathlib").Path("k.toml"))
    tracker = ReadinessTracker(cfg.readiness)
    tracker.feed("Loading safetensors checkpoint shards:  57% Completed | 68/119 [04:12<03:10,  3.73s/it]")
    assert tracker.headline(252.0, "~3m10s left") == "loading weights 68/119 (57%), 4m12s, ~3m10s left"
    assert tracker.headline(252.0) == "loading weights 68/119 (57%), 4m12s"
