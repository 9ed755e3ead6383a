"""Prometheus metrics for node_exporter's textfile collector (`[metrics] textfile`).

The supervisor serves no HTTP of its own; node_exporter reads `*.prom` files
from its textfile directory.  A snapshot of numbers goes through
prometheus_client (its own CollectorRegistry, its exposition format) and is
replaced atomically.  Not via `write_to_textfile`: that leaves the file's mode
to the umask (the unit's `UMask=0077` would hide it from node_exporter's user)
and does not fsync; `atomicfile.write_atomic` does both around the same
`generate_latest` bytes.

Counters come from the run history's cumulative counters, so they do not
reset when systemd restarts the service (a reset would read as a rate spike).

Every series carries `deployment` (docs/operators-view.md): node_exporter serves every
deployment's textfile of a host at once, and the alerts
(packaging/prometheus/kimi-supervisor.rules.yml) name the one to look at.
And `role` (docs/operators-view.md): a weight holder and its engine share the deployment's
name, so without it their two textfiles held the same series and node_exporter
refused the scrape ("collected before with the same name and label values").
Label values come from bounded sets only (state, GPU index, exit code and its
name); the failure's text stays in the state file and the journal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kimi_supervisor import __version__
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.files.atomic import write_atomic
from kimi_supervisor.host.gpu import MIB
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.roles import Role
from kimi_supervisor.states import State

PREFIX = "kimi_supervisor"


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    state: str
    ready_timestamp_s: float | None = None
    last_load_s: float | None = None
    restarts: int = 0
    preflight_kills: int = 0
    shm_removed: int = 0
    health_latency_s: float | None = None
    canary_latency_s: float | None = None
    gpu_used_mib_at_start: Mapping[int, int] = dataclasses.field(default_factory=dict)
    last_failure: tuple[int, str] | None = None  # (exit code, root cause)
    started_timestamp_s: float | None = None  # this run's start (the alerts time a load from it)
    last_failure_timestamp_s: float | None = None
    # The latest successful load broken down (opsview/loadreport.py): {phase: seconds}, compile cache hit.
    load_phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    compile_cache_hit: bool | None = None
    load_cached_fraction: float | None = None


class _SnapshotCollector(Collector):
    def __init__(self, snap: MetricsSnapshot, deployment: str, role: str, file: str | None) -> None:
        self.snap = snap
        self.deployment = deployment
        self.role = role
        self.file = file

    def _family(
        self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, documentation: str, *labels: str
    ) -> GaugeMetricFamily | CounterMetricFamily:
        return kind(f"{PREFIX}_{name}", documentation, labels=["deployment", "role", *labels])

    def _one(self, name: str, documentation: str, value: float, kind: type = GaugeMetricFamily) -> Metric:
        family = self._family(kind, name, documentation)
        family.add_metric([self.deployment, self.role], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s, dep, role = self.snap, self.deployment, self.role
        state = self._family(
            GaugeMetricFamily, "state", "1 for the supervisor's current lifecycle state, 0 for the others", "state"
        )
        for candidate in State:
            state.add_metric([dep, role, candidate.value], 1.0 if candidate.value == s.state else 0.0)
        yield state
        # Which build runs (pyproject's setuptools-scm version), as node_exporter's own node_exporter_build_info:
        # after a rollout, `count by (version) (kimi_supervisor_build_info)` shows the hosts still on the old one.
        build = InfoMetricFamily(f"{PREFIX}_build", "The kimi-supervisor build writing this textfile (its version)")
        build.add_metric([], {"deployment": dep, "role": role, "version": __version__})
        yield build
        if self.file is not None:
            # node_exporter says when each file last changed (node_textfile_mtime_seconds{file}); this names the
            # deployment a file is, so a rule can tell a textfile whose supervisor stopped writing.
            textfile = InfoMetricFamily(f"{PREFIX}_textfile", "The textfile this deployment's supervisor writes")
            textfile.add_metric([], {"deployment": dep, "role": role, "file": self.file})
            yield textfile
        yield self._one(
            "ready_timestamp_seconds", "Unix time this run sent READY=1 (0 while not ready)", s.ready_timestamp_s or 0.0
        )
        if s.started_timestamp_s is not None:
            yield self._one(
                "start_timestamp_seconds", "Unix time this run of the supervisor started", s.started_timestamp_s
            )
        if s.last_load_s is not None:
            yield self._one("last_load_seconds", "Spawn to ready of the latest successful load", s.last_load_s)
        counters = (
            ("restarts", "Starts of the supervisor after the first one this state directory saw", s.restarts),
            ("preflight_kills", "Stale GPU-holding processes the preflight killed", s.preflight_kills),
            ("shm_removals", "Stale shared-memory files the preflight removed", s.shm_removed),
        )
        for name, documentation, value in counters:
            yield self._one(name, documentation, value, CounterMetricFamily)
        if s.health_latency_s is not None:
            yield self._one("health_latency_seconds", "Duration of the latest GET /health", s.health_latency_s)
        if s.canary_latency_s is not None:
            yield self._one("canary_latency_seconds", "Duration of the latest canary completion", s.canary_latency_s)
        if s.load_phases:
            phases = self._family(
                GaugeMetricFamily,
                "load_phase_seconds",
                "Seconds each phase of the latest successful load took, from vLLM's own lines (phases overlap: "
                "init_engine holds compile and graphs)",
                "phase",
            )
            for phase, seconds in s.load_phases.items():
                phases.add_metric([dep, role, phase], seconds)
            yield phases
        if s.compile_cache_hit is not None:
            yield self._one(
                "compile_cache_hit",
                "1 when the latest successful load found its torch.compile cache, 0 when it compiled",
                1.0 if s.compile_cache_hit else 0.0,
            )
        if s.load_cached_fraction is not None:
            yield self._one(
                "load_cached_ratio",
                "Share of the model's shards the page cache held just before the latest successful load",
                s.load_cached_fraction,
            )
        gpu = self._family(
            GaugeMetricFamily,
            "gpu_memory_used_at_start_bytes",
            "GPU memory in use when vLLM was spawned (after the preflight), per GPU",
            "gpu",
        )
        for index, mib in sorted(s.gpu_used_mib_at_start.items()):
            gpu.add_metric([dep, role, str(index)], float(mib * MIB))
        yield gpu
        if s.last_failure is not None:
            # Labels from a bounded set only: the root cause is vLLM's text (maybe a client's words) and would
            # make a new series per failure; `kimi-supervisor status` and the journal quote it.
            code = s.last_failure[0]
            labels = {"deployment": dep, "role": role, "exit_code": str(code), "reason": failure_reason(code)}
            info = InfoMetricFamily(
                f"{PREFIX}_last_failure", "Exit code and reason (from the exit code) of the latest failed run"
            )
            info.add_metric([], labels)
            yield info
            if s.last_failure_timestamp_s is not None:
                when = GaugeMetricFamily(
                    f"{PREFIX}_last_failure_timestamp_seconds",
                    "Unix time of the latest failed run's end, by its exit code",
                    labels=list(labels),
                )
                when.add_metric(list(labels.values()), s.last_failure_timestamp_s)
                yield when


def failure_reason(code: int) -> str:
    """The exit code's name (`child_died`, `gpu_failed`, ...), or `unknown`: one of a fixed set."""
    try:
        return ExitCode(code).name.lower()
    except ValueError:
        return "unknown"


def render(snap: MetricsSnapshot, deployment: str, role: str = Role.ENGINE.value, file: str | None = None) -> bytes:
    """`file`: the textfile's name, published as kimi_supervisor_textfile_info{file} (the staleness rule's join)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, deployment, role, file))
    data: bytes = generate_latest(registry)
    return data


class MetricsWriter:
    """Writes snapshots to `path`; an unwritable path is warned about once per outage, never raised."""

    def __init__(self, path: Path, log: Logger, deployment: str, role: str = Role.ENGINE.value) -> None:
        self.path = path
        self.deployment = deployment
        self.role = role
        self._log = log
        self._warned = False

    def write(self, snap: MetricsSnapshot) -> None:
        try:
            write_atomic(self.path, render(snap, self.deployment, self.role, self.path.name))
            self._warned = False
        except OSError as exc:
            if not self._warned:
                self._log.warning("metrics.unwritable", path=str(self.path), error=str(exc), why="serving goes on")
                self._warned = True
