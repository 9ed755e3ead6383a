"""The front's /front/metrics (docs/front.md, Metrics and status): numbers that say what clients saw."""

from __future__ import annotations

from kimi_supervisor import __version__
from kimi_supervisor.deployment.front.metrics import FrontMetrics

PLANNED = {"kind": "planned", "engine_exit_code": 0, "holder_assisted": False}


def _sample(metrics: FrontMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"deployment": "kimi-a"})


def test_the_last_outage_client_wait_is_that_outages_own_sum() -> None:
    """Held requests record their waits as they go through, just after the outage ended: the gauge is the outage
    they waited in (was: set at the end, before them, so it showed the outage before, and 0 after the first)."""
    m = FrontMetrics("kimi-a")
    m.outage_began(100.0)
    m.waited(1.5)  # one gave up during it (rejected_timeout)
    m.outage_ended(110.0, PLANNED)
    assert _sample(m, "kimi_front_last_outage_client_wait_seconds") == 1.5
    m.waited(9.0)  # the held ones, released once the engine serves
    m.waited(8.5)
    assert _sample(m, "kimi_front_last_outage_client_wait_seconds") == 19.0
    assert m.outages_seen[-1]["client_wait_s"] == 19.0
    m.outage_began(200.0)  # nobody waited in this one
    assert _sample(m, "kimi_front_last_outage_client_wait_seconds") == 19.0  # the last one that ended
    m.outage_ended(205.0, PLANNED)
    assert _sample(m, "kimi_front_last_outage_client_wait_seconds") == 0.0


def test_the_front_says_its_build_and_has_no_created_twins() -> None:
    """A build-info series like the engine's textfile (`kimi_supervisor_build_info`, role "front"), and no `_created`
    series beside each counter and histogram (prometheus_client's default), which nothing reads."""
    text = FrontMetrics("kimi-a").text().decode()
    build = f'kimi_supervisor_build_info{{deployment="kimi-a",role="front",version="{__version__}"}} 1.0'
    assert build in text.splitlines()
    assert "_created" not in text
    assert 'kimi_front_requests_total{deployment="kimi-a",outcome="held"} 0.0' in text.splitlines()
