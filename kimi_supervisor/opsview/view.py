"""The operator's view of a run: the state file, the run history, the load ETA, the metrics textfile.

One observer, fed by small hooks so the lifecycle code stays readable:
the state machine calls `on_state` on each transition, everything the
supervisor tells systemd passes through `tap` (STATUS= text, WATCHDOG=1
pings), the loop hands over health results (`on_health`) and calls `tick`,
which refreshes the process tree and GPU memory (every 2 s while starting,
every health interval once ready) and rewrites the state file at most once a
second.  Its clocks (wall for the file's timestamps, monotonic for refreshes, ETA and elapsed) and the
process table come in (`Supervisor` passes its own), so it follows fake time in the lifecycle tests.
Nothing here may stop a run: files that cannot be written are warned
about once, and an unexpected error in this module is logged, not raised.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from kimi_supervisor import __version__
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.child.spawnplan import Unresolvable, account, resolve_identity
from kimi_supervisor.config import layout, role_spec
from kimi_supervisor.config.model import Config, WeightsConfig
from kimi_supervisor.config.spare import output_key
from kimi_supervisor.host import checkpoint
from kimi_supervisor.host.gpu import GpuProbe, GpuUnavailable
from kimi_supervisor.host.proctable import ProcessTable, PsutilProcessTable
from kimi_supervisor.liveness.health_probe import HealthResult
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview.eta import LoadEta
from kimi_supervisor.opsview.history import History
from kimi_supervisor.opsview.loadreport import phases_of
from kimi_supervisor.opsview.loadwatch import LoadWatch
from kimi_supervisor.opsview.statefile import SCHEMA, StateFile, process_start_time
from kimi_supervisor.opsview.textfile import MetricsSnapshot, MetricsWriter
from kimi_supervisor.opsview.tree import describe_tree, with_gpu_memory
from kimi_supervisor.states import State
from kimi_supervisor.systemd.notify import Notifier

STARTING_REFRESH_S = 2.0
STOPPING_REFRESH_S = 1.0
WRITE_EVERY_S = 1.0
# The loop wakes for every burst of output; progress lines come seconds apart.
OBSERVE_EVERY_S = 0.25

_F = TypeVar("_F", bound=Callable[..., Any])


def _never_fatal(method: _F) -> _F:
    """The view reports on the service; a bug in it must not take the service down."""

    @functools.wraps(method)
    def wrapper(self: OperatorView, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            if method.__name__ not in self._failed_methods:  # once per method, not every tick
                self._failed_methods.add(method.__name__)
                self._log.error("operator_view.error", method=method.__name__, traceback=traceback.format_exc())
            return None

    return cast(_F, wrapper)


class _Tap:
    """A Notifier that passes everything on and lets the view see it."""

    def __init__(self, inner: Notifier, view: OperatorView) -> None:
        self._inner = inner
        self._view = view

    def send(self, **fields: str | int) -> None:
        self._inner.send(**fields)
        self._view.on_notify(fields)


def _holder_doc(cfg: Config, w: WeightsConfig) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "role": "holder",
        "key": dict(w.key),
        "health_url": cfg.readiness.health_url,
        "socket_dir": str(w.socket_dir),
    }
    # Its engine must run as the same account: vLLM checks the sockets' owner (lifecycle/holderwait.py).
    with contextlib.suppress(Unresolvable):  # the start itself fails on it, exit 78, before the spawn
        doc["child_user"], doc["child_uid"] = account(resolve_identity(cfg.child.user, cfg.child.group))
    return doc


def _engine_doc(cfg: Config, w: WeightsConfig) -> dict[str, Any]:
    return {"role": "engine", "holder_state": str(layout.holder_of(cfg).state_file), "socket_dir": str(w.socket_dir)}


# The state file's document says which side of the pair wrote it: the side is the role's (config/role_spec.py).
_WEIGHTS_DOCS: dict[str, Callable[[Config, WeightsConfig], dict[str, Any]]] = {
    "holder": _holder_doc,
    "engine": _engine_doc,
}


def weights_doc(cfg: Config) -> dict[str, Any]:
    """The holder's cache key and /health (its engine checks both before it starts), or an engine's holder."""
    assert cfg.weights is not None
    return _WEIGHTS_DOCS[role_spec.of(cfg.role).weights_side](cfg, cfg.weights)


class GpuOutage:
    """The journal's side of an NVML error while the view refreshes: one warning with NVML's words when an outage
    begins, one info record when a refresh works again, for the first outage of each kind (its words) only.

    The state file's `gpu_error` is replaced at the next refresh that works, so without a record a transient
    error leaves no trace.  Not error level, and not every refresh: the view only reports (whether a GPU fault
    ends the run is the liveness checks' call, which log it themselves), and NVML flapping every 2 s must not
    bury their records (docs/operators-view.md)."""

    KINDS_KEPT = 16  # distinct texts remembered; past that, every outage is quiet (a record per refresh is worse)

    def __init__(self, log: Logger) -> None:
        self._log = log
        self._seen: set[str] = set()
        self._current: str | None = None  # the error of the outage in progress, when its start was logged
        self._failed = 0

    def refreshed(self, error: str | None) -> None:
        if error is None:
            if self._current is not None:
                self._log.info("operator_view.gpu_readable", error=self._current, failed_refreshes=self._failed)
            self._current, self._failed = None, 0
            return
        self._failed += 1
        if self._failed == 1 and error not in self._seen and len(self._seen) < self.KINDS_KEPT:
            self._seen.add(error)
            self._current = error
            self._log.warning("operator_view.gpu_unreadable", error=error)


class OperatorView:
    def __init__(
        self,
        cfg: Config,
        probe: GpuProbe,
        log: Logger,
        tracker: ReadinessTracker,
        watchdog_s: float | None,
        *,
        table: ProcessTable | None = None,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._probe = probe
        self._table: ProcessTable = table if table is not None else PsutilProcessTable()
        self._log = log
        self._tracker = tracker
        self._wall = wall
        self._mono = mono
        self._failed_methods: set[str] = set()
        self._gpu_outage = GpuOutage(log)
        pid = os.getpid()
        own = layout.of(cfg)  # this deployment's own files, beside the host's other deployments'
        self.state_file = StateFile(own.runtime, log, own.state_file.name)
        self.history = History(own.history_file, log, pid)
        textfile = cfg.metrics.textfile
        self.metrics = MetricsWriter(textfile, log, cfg.deployment.name, cfg.role.value) if textfile else None
        self.eta = LoadEta(None)
        self.load = LoadWatch(cfg.child.vllm.model, self._table)  # the start broken down (loadwatch.py)
        self._load_recorded = False
        self._child_pid: int | None = None
        self._spawned_mono: float | None = None
        self._gpu_at_start: dict[int, int] = {}
        self._last_refresh = self._last_write = self._last_metrics = self._last_observe = -1e9
        self._dirty = False
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "supervisor": {
                "pid": pid,
                "start_time": process_start_time(pid),
                "version": __version__,
                "config": os.path.abspath(cfg.path),
            },
            "phase": State.PREFLIGHT.value,
            "status": "",
            "since": wall(),
            "started_at": wall(),
            "spawned_at": None,
            "ready_at": None,
            "ended_at": None,
            "exit_code": None,
            "updated_at": wall(),
            "loading": None,
            "processes": [],
            "gpus": [],
            "gpu_error": None,
            "health": {"ok": None, "latency_s": None, "at": None, "error": None, "consecutive_failures": 0},
            "canary": {"ok": None, "latency_s": None, "at": None},  # null until the first canary (liveness/engine.py)
            "watchdog": {"enabled": watchdog_s is not None, "interval_s": watchdog_s, "last_ping_at": None, "pings": 0},
            "last_failure": None,
            "output_key": None,
        }
        if cfg.weights is not None:  # docs/weight-holder.md: the holder's key and health, where its engine reads them
            self.doc["weights"] = weights_doc(cfg)
        spec = role_spec.of(cfg.role)
        if spec.takes_spare or spec.child_of_engine:
            # docs/spare.md: what decides its tokens, hashed; the front sends nothing to a spare whose key is not its
            # engine's (the engine's argv edited and restarted since the spare started).
            self.doc["output_key"] = output_key(cfg.child.argv, dict(cfg.child.env))

    # -- hooks --------------------------------------------------------------------

    def tap(self, inner: Notifier) -> Notifier:
        return _Tap(inner, self)

    @_never_fatal
    def on_notify(self, fields: Mapping[str, str | int]) -> None:
        if "STATUS" in fields:
            self.doc["status"] = str(fields["STATUS"])
            self._dirty = True
        if "WATCHDOG" in fields:
            wd = self.doc["watchdog"]
            wd["last_ping_at"], wd["pings"] = self._wall(), wd["pings"] + 1
            self._dirty = True

    @_never_fatal
    def on_state(self, state: State, headline: str, fields: Mapping[str, Any]) -> None:
        now = self._wall()
        self.doc.update(phase=state.value, status=headline, since=now)
        if state is State.PREFLIGHT:
            self.history.begin(now)
            self.eta = LoadEta(self.history.data.last_successful_load())
            self.doc["last_failure"] = self._last_failure_from_history()
        elif state is State.STARTING:
            self._child_pid = fields.get("pid")
            self._spawned_mono = self._mono()
            self.doc["spawned_at"] = now
            self._refresh()
            self._gpu_at_start = {g["index"]: g["used_mib"] for g in self.doc["gpus"]}
        elif state is State.READY:
            self.doc["ready_at"] = now
            self.doc["loading"] = None
            load_s = float(fields.get("startup_s", now - (self.doc["spawned_at"] or now)))
            tail = None if self.eta.weights_done_at is None else self._mono() - self.eta.weights_done_at
            self.history.ready(now, load_s, tail)
            self._record_load()
            self._refresh()
        elif state in (State.STOPPED, State.FAILED):
            code = int(fields.get("exit_code", 0))
            cause = headline.removeprefix("failed: ") if state is State.FAILED else fields.get("root_cause")
            self.doc.update(ended_at=now, exit_code=code, loading=None, processes=[])
            incident = fields.get("incident")  # the evidence taken before the stop (forensics.py)
            if state is State.FAILED:
                failure = {"at": now, "exit_code": code, "root_cause": cause}
                self.doc["last_failure"] = {**failure, "incident": incident} if incident else failure
            if self._spawned_mono is not None:
                self._record_load()  # a start that never got ready: the phases it did reach
            self.history.end(now, code, cause, incident)
        self._write(force_metrics=True)

    @_never_fatal
    def on_incident(self, path: str | None) -> None:
        """An incident taken while the run goes on (the watchdog's coming kill): named in the run's record now."""
        self.history.incident(path)

    @_never_fatal
    def on_preflight(self, kills: int, shm_removed: int) -> None:
        self.history.count("preflight_kills_total", kills)
        self.history.count("shm_removed_total", shm_removed)

    def before_spawn(self) -> None:
        """Just before vLLM starts reading: the holder's checkpoint fingerprint, the page cache's share."""
        self._record_checkpoint()
        self._measure_cache()

    @_never_fatal
    def _measure_cache(self) -> None:
        self.load.before_spawn()  # loadwatch.py

    @_never_fatal
    def _record_checkpoint(self) -> None:
        """A holder records the checkpoint it is about to load, as vLLM fingerprints it (host/checkpoint.py): its
        engines compare theirs before they start.  Unreadable: recorded as unknown, and the daemon's own key check
        is the one left."""
        if not role_spec.of(self._cfg.role).records_checkpoint or self._cfg.weights is None:
            return
        model = self._cfg.weights.key.get("model")
        try:
            found = checkpoint.fingerprint(model)
        except checkpoint.CheckpointError as exc:
            self._log.warning("weights.checkpoint_unknown", model=model, error=str(exc))
            found = None
        self.doc["weights"]["checkpoint"] = None if found is None else found.to_doc()
        if found is not None:
            self._log.info("weights.checkpoint", model=model, digest=found.digest, shards=len(found.shards))
        self._dirty = True

    @_never_fatal
    def read_rate_text(self) -> str | None:
        """`1.02 GB/s`: what the child's tree read from storage over the last seconds, for STATUS=."""
        return self.load.rate_text()

    @_never_fatal
    def on_health(self, result: HealthResult) -> None:
        h = self.doc["health"]
        h.update(ok=result.ok, latency_s=round(result.latency_s, 6), at=self._wall(), error=result.error)
        h["consecutive_failures"] = 0 if result.ok else h["consecutive_failures"] + 1
        self._dirty = True

    @_never_fatal
    def on_canary(self, ok: bool, latency_s: float) -> None:
        self.doc["canary"] = {"ok": ok, "latency_s": round(latency_s, 6), "at": self._wall()}
        self._dirty = True

    @_never_fatal
    def eta_text(self, elapsed_s: float) -> str | None:
        """`~3m10s left` for STATUS=, or None when there is no basis for an estimate."""
        self._observe_loading()
        est = self.eta.estimate(self._mono(), elapsed_s)
        return est.text() if est else None

    @_never_fatal
    def tick(self) -> None:
        """Called from the loop on every wake-up: cheap unless a refresh or a write is due."""
        mono = self._mono()
        phase = self.doc["phase"]
        every = {
            State.STARTING.value: STARTING_REFRESH_S,
            State.READY.value: self._cfg.health.interval_s,
            State.STOPPING.value: STOPPING_REFRESH_S,
        }.get(phase)
        if every is not None and mono - self._last_refresh >= every:
            self._refresh()
        if phase == State.STARTING.value and mono - self._last_observe >= OBSERVE_EVERY_S:
            self._observe_loading()
        if self._dirty and mono - self._last_write >= WRITE_EVERY_S:
            self._write(force_metrics=False)

    # -- internals ----------------------------------------------------------------

    def _observe_loading(self) -> None:
        if self.doc["phase"] != State.STARTING.value or self._spawned_mono is None:
            return
        mono = self._last_observe = self._mono()
        t = self._tracker
        self.eta.observe(mono, t.progress, t.weights_loaded)
        elapsed = mono - self._spawned_mono
        est = self.eta.estimate(mono, elapsed)
        p = t.progress
        self.doc["loading"] = {
            "phase": t.phase,
            "shards_done": p.done if p else None,
            "shards_total": p.total if p else None,
            "percent": p.percent if p else None,
            "elapsed_s": round(elapsed, 1),
            "eta_s": round(est.remaining_s, 1) if est else None,
            "eta_basis": est.basis if est else None,
        }
        self._dirty = True

    def _record_load(self) -> None:
        if not self._load_recorded:
            self._load_recorded = True
            self.history.load(self.load.record(self._tracker.load.breakdown))

    def _refresh(self) -> None:
        self._last_refresh = self._mono()
        members = describe_tree(self._table, self._child_pid) if self._child_pid else []
        if self._child_pid and self.doc["phase"] == State.STARTING.value:
            self.load.sample(self._last_refresh, self._child_pid)
        gpus, error = self._gpus()
        gpu_rows: list[dict[str, Any]] = []
        if gpus:
            try:
                members = with_gpu_memory(members, self._probe, gpus)
                for index in gpus:
                    m = self._probe.memory(index)
                    gpu_rows.append({"index": index, "used_mib": m.used_mib, "total_mib": m.total_mib})
            except GpuUnavailable as exc:
                error = str(exc)
        self.doc.update(processes=[m.to_dict() for m in members], gpus=gpu_rows, gpu_error=error)
        self._dirty = True
        self._gpu_outage.refreshed(error)

    def _gpus(self) -> tuple[tuple[int, ...], str | None]:
        if self._cfg.preflight.gpus is not None:
            return self._cfg.preflight.gpus, None
        try:
            return tuple(range(self._probe.device_count())), None
        except GpuUnavailable as exc:
            return (), str(exc)

    def _last_failure_from_history(self) -> dict[str, Any] | None:
        for run in reversed(self.history.data.runs):
            if run.exit_code not in (None, 0) or (run.exit_code is None and run.root_cause):
                failure = {"at": run.end, "exit_code": run.exit_code, "root_cause": run.root_cause}
                return {**failure, "incident": run.incident} if run.incident else failure
        return None

    def _write(self, force_metrics: bool) -> None:
        mono = self._mono()
        self.doc["updated_at"] = self._wall()
        self.state_file.write(self.doc)
        self._last_write, self._dirty = mono, False
        if self.metrics and (force_metrics or mono - self._last_metrics >= self._cfg.health.interval_s):
            self._last_metrics = mono
            self.metrics.write(self._snapshot())

    def _snapshot(self) -> MetricsSnapshot:
        counters = self.history.data.counters
        last = self.history.data.last_successful_load()
        failure = self.doc["last_failure"]
        return MetricsSnapshot(
            state=self.doc["phase"],
            ready_timestamp_s=self.doc["ready_at"],
            last_load_s=last.load_s if last else None,
            restarts=max(0, counters["starts_total"] - 1),
            preflight_kills=counters["preflight_kills_total"],
            shm_removed=counters["shm_removed_total"],
            health_latency_s=self.doc["health"]["latency_s"],
            canary_latency_s=self.doc["canary"]["latency_s"],
            gpu_used_mib_at_start=self._gpu_at_start,
            last_failure=((int(failure["exit_code"] or 0), str(failure["root_cause"] or "")) if failure else None),
            started_timestamp_s=self.doc["started_at"],
            last_failure_timestamp_s=failure["at"] if failure else None,
            load_phases=phases_of(last) if last else {},
            compile_cache_hit=None if last is None or last.compile_cache is None else last.compile_cache == "hit",
            load_cached_fraction=last.cached_fraction if last else None,
        )
