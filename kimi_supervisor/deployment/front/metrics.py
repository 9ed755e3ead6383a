"""What clients saw of the engine's restarts (docs/front.md, Metrics and status): the front's /front/metrics."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from kimi_supervisor import __version__

OUTCOMES = (
    "forwarded",  # answered by the engine at the first try
    "held",  # waited for the engine, then answered
    "retried",  # a non-streamed request sent again after a restart, then answered
    "resumed",  # a stream continued through the token-in route after a restart
    "failed_restart",  # a restart broke it and it could not be completed (the alert's input)
    "refused_route",  # a control route not in front.allow_routes
    "rejected_full",  # queue_max requests held already
    "rejected_timeout",  # the engine was not back within hold_s
    "rejected_too_large",  # a completion's body past front.max_body_bytes (413)
    "rejected_held_bytes",  # its body would pass front.max_held_bytes, all kept bodies together (503)
    "refused_coding",  # a body with a Content-Encoding (415: bodies.py)
)
RESTART_FAILURES = ("failed_restart", "rejected_full", "rejected_timeout")
KEEP_OUTAGES = 10  # in the state file
KEEP_FAILOVERS = 10  # in the state file


class SpareReadiness:
    """How long the deployment has run without a ready spare (docs/spare.md), and whether that passed the alert's
    bound (`front.spare_alert_s`); times are the caller's monotonic clock."""

    def __init__(self, alert_s: float) -> None:
        self.alert_s = alert_s
        self.ready = False
        self._without_since: float | None = None
        self._alerted = False  # the crossing of the bound was reported in this stretch without a spare

    def update(self, ready: bool, now: float) -> bool:
        """Record what the probe saw; True exactly when the bound is crossed (the watch logs it once)."""
        self.ready = ready
        if ready:
            self._without_since, self._alerted = None, False
            return False
        if self._without_since is None:
            self._without_since = now
        crossed = self.alerting(now) and not self._alerted
        self._alerted = self._alerted or crossed
        return crossed

    def without_s(self, now: float) -> float:
        """Seconds without a ready spare so far; 0 while one is ready."""
        return 0.0 if self._without_since is None else now - self._without_since

    def alerting(self, now: float) -> bool:
        return self._without_since is not None and self.without_s(now) > self.alert_s


class FrontMetrics:
    """Every series carries `deployment`, as the engine supervisor's textfile does: one alert rule covers every
    deployment (packaging/prometheus/kimi-supervisor.rules.yml)."""

    def __init__(self, deployment: str = "kimi-supervisor") -> None:
        # Without it every counter and histogram has a `_created` twin (its creation time), which no rule here
        # reads and which doubles the series; process-wide, and the front's process has no other registry.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client
        self.registry = r = CollectorRegistry()
        d = ["deployment"]
        # Which build serves, as the engine's textfile says it (opsview/textfile.py): one
        # `count by (version) (kimi_supervisor_build_info)` covers the fronts too.
        Info("kimi_supervisor_build", "The kimi-supervisor build serving this front (its version)", registry=r).info(
            {"deployment": deployment, "role": "front", "version": __version__}
        )
        self._requests = Counter("kimi_front_requests", "Requests the front finished", [*d, "outcome"], registry=r)
        for outcome in OUTCOMES:
            self._requests.labels(deployment, outcome)
        self._deployment = deployment
        self.serving = Gauge("kimi_front_engine_serving", "1 while the engine serves", d, registry=r).labels(deployment)
        self.held = Gauge("kimi_front_held_requests", "Requests waiting for the engine now", d, registry=r).labels(
            deployment
        )
        self.hold_seconds = Histogram(
            "kimi_front_hold_seconds",
            "How long a request waited for the engine",
            d,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900),
            registry=r,
        ).labels(deployment)
        self.outages = Counter("kimi_front_outages", "The engine stopped serving", d, registry=r).labels(deployment)
        # Counted when an outage ends: its kind is learnt from the engine's history then (outages.py).
        self._ended = Counter(
            "kimi_front_outages_ended", "Outages that ended, by kind of restart", [*d, "kind"], registry=r
        )
        self.last_outage_wait = Gauge(
            "kimi_front_last_outage_client_wait_seconds",
            "Seconds clients waited, summed, in the last outage",
            d,
            registry=r,
        ).labels(deployment)
        self.restart_failures = Counter(
            "kimi_front_restart_failures", "Requests that failed because of an engine restart", d, registry=r
        ).labels(deployment)
        # The hot spare (docs/spare.md): which engine new requests go to, the failovers between them and how long
        # each took (an engine's death to the first request sent to the other), and whether a spare is ready.
        self.serving_engine = Gauge(
            "kimi_front_serving_engine", "1 for the engine new requests go to now", [*d, "engine"], registry=r
        )
        self._failovers = Counter(
            "kimi_front_failovers",
            "New requests went to another engine: the one they went to died",
            [*d, "to"],
            registry=r,
        )
        self.last_failover_seconds = Gauge(
            "kimi_front_last_failover_seconds",
            "From an engine's death to the first request sent to another, in the last failover",
            d,
            registry=r,
        ).labels(deployment)
        self.spare_ready = Gauge("kimi_front_spare_ready", "1 while a hot spare serves", d, registry=r).labels(
            deployment
        )
        self.no_ready_spare_seconds = Gauge(
            "kimi_front_no_ready_spare_seconds", "How long the deployment has run without a ready spare", d, registry=r
        ).labels(deployment)
        self.no_ready_spare_alert = Gauge(
            "kimi_front_no_ready_spare_alert",
            "1 once the deployment has run without a ready spare longer than front.spare_alert_s",
            d,
            registry=r,
        ).labels(deployment)
        self.failovers_seen: list[dict[str, float | str]] = []  # the last ones, newest last (the state file's)
        self.counts = dict.fromkeys(OUTCOMES, 0)  # the same numbers for the state file and the tests
        # The last outages (the engine not serving, from the front's view), newest last: when each began and
        # ended, the seconds clients waited, and what became of the requests it touched (docs/front.md).
        self.outages_seen: list[dict[str, float | int | str | bool | None]] = []

    def finished(self, outcome: str) -> None:
        self._requests.labels(self._deployment, outcome).inc()
        self.counts[outcome] += 1
        if outcome in RESTART_FAILURES:
            self.restart_failures.inc()
        # Held, retried, resumed or failed requests end during or just after an outage: the latest one's.
        key = "failed" if outcome in RESTART_FAILURES else outcome
        if self.outages_seen and key in ("held", "retried", "resumed", "failed"):
            latest = self.outages_seen[-1]
            latest[key] = int(latest[key] or 0) + 1

    def waited(self, seconds: float) -> None:
        """A request's wait, recorded when it ends: a held one's just after the outage it waited in has ended (the
        engine serves again, then the held requests go through), so it counts for the latest outage, and the gauge
        follows it once that outage has ended (was: set at the end, before these waits, so it showed the outage
        before)."""
        self.hold_seconds.observe(seconds)
        if self.outages_seen:
            latest = self.outages_seen[-1]
            total = float(latest["client_wait_s"] or 0.0) + seconds
            latest["client_wait_s"] = total
            if latest["ended"] is not None:
                self.last_outage_wait.set(total)

    def outage_began(self, at: float) -> None:
        self.outages.inc()
        record: dict[str, float | int | str | bool | None] = {"began": at, "ended": None, "kind": None}
        record |= {"client_wait_s": 0.0, "held": 0, "retried": 0, "resumed": 0, "failed": 0}
        self.outages_seen = [*self.outages_seen[-(KEEP_OUTAGES - 1) :], record]

    def outage_ended(self, at: float, kind: dict[str, object] | None) -> None:
        """`kind`: outages.outage_kind's (the kind, the engine's exit code, whether its holder helped); None when no
        outage was under way (the front's first sight of the engine serving)."""
        if kind is None:
            return
        if self.outages_seen:
            latest = self.outages_seen[-1]
            latest["ended"] = at
            for key in ("kind", "engine_exit_code", "holder_assisted"):
                value = kind.get(key)
                latest[key] = value if isinstance(value, (int, str, bool)) or value is None else str(value)
            # What waited during it so far (requests that gave up); those held add theirs as they go through.
            self.last_outage_wait.set(float(latest["client_wait_s"] or 0.0))
        self._ended.labels(self._deployment, str(kind.get("kind"))).inc()

    def failover(self, died: str, to: str, seconds: float, at: float) -> None:
        """New requests went from `died` to `to`, `seconds` after its death; `at`: wall clock, for the record."""
        self._failovers.labels(self._deployment, to).inc()
        self.last_failover_seconds.set(seconds)
        record: dict[str, float | str] = {"at": at, "died": died, "to": to, "first_request_s": seconds}
        self.failovers_seen = [*self.failovers_seen[-(KEEP_FAILOVERS - 1) :], record]

    def text(self) -> bytes:
        return bytes(generate_latest(self.registry))
