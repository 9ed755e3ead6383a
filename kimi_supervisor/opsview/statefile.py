"""The live state file (`<runtime_directory>/state.json`): written by the daemon, read by `status`.

The daemon replaces it atomically whenever something an operator would want
to see changed (at most about once a second, at once on a transition), mode
0644 so `kimi-supervisor status` needs no root.  It carries no secrets: roles,
PIDs, numbers and the root-cause line (child lines are already redacted).

A reader must not trust the phase of a file whose writer is gone: `supervisor`
names the writer's PID *and* its start time, so a recycled PID is not mistaken
for a live supervisor.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, cast

import psutil

from kimi_supervisor.files.atomic import ensure_directory, write_atomic
from kimi_supervisor.files.untrusted import (
    boolean,
    integer,
    items,
    mapping,
    number,
    read_json,
    string,
)
from kimi_supervisor.host.procident import ProcIdent, same_process
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.quoting import escape_unprintable
from kimi_supervisor.roles import Role
from kimi_supervisor.untrusted_json import Untrusted

SCHEMA = 1
FILE_NAME = Role.ENGINE.state_file_name  # the engine's; another role's is named by config/layout.py
# Every key a reader may rely on (the tests check the daemon writes exactly these).
TOP_LEVEL_KEYS = (
    "schema",
    "supervisor",
    "phase",
    "status",
    "since",
    "started_at",
    "spawned_at",
    "ready_at",
    "ended_at",
    "exit_code",
    "updated_at",
    "loading",
    "processes",
    "gpus",
    "gpu_error",
    "health",
    "canary",
    "watchdog",
    "last_failure",
    # What decides an engine's tokens, hashed (config/spare.py output_key): an engine's and its hot spare's, which
    # the front compares (docs/spare.md); null for a role whose child serves no tokens.
    "output_key",
)


def process_start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class StateFile:
    """Writes the document; a failure is warned about once per outage and never raised (serving goes on)."""

    def __init__(self, directory: Path, log: Logger, name: str = FILE_NAME) -> None:
        self.path = directory / name  # state.json, or the weight holder's state.weights.json (config/layout.py)
        self._log = log
        self._warned = False

    def write(self, doc: dict[str, Any]) -> bool:
        try:
            ensure_directory(self.path.parent)
            write_atomic(self.path, (json.dumps(doc, indent=1) + "\n").encode())
        except OSError as exc:
            if not self._warned:
                self._log.warning("state_file.unwritable", path=str(self.path), error=str(exc), why="serving goes on")
                self._warned = True
            return False
        if self._warned:
            self._log.info("state_file.writable_again", path=str(self.path))
            self._warned = False
        return True


MAX_BYTES = 1 << 20  # a state file is a few KiB; its process list is capped at 4096 entries
MAX_DEPTH = 8  # the document nests 4 deep (processes -> process -> gpus -> gpu)
PHASES = ("preflight", "starting", "ready", "stopping", "stopped", "failed")
TIMES = ("since", "started_at", "spawned_at", "ready_at", "ended_at", "updated_at")
PID_MAX = 1 << 22  # the kernel's largest pid_max


def read_state(path: Path) -> dict[str, Any] | None:
    """The document at `path`, or None when there is none; ValueError (untrusted.Untrusted) when it is not one.

    Every field `status` renders is checked here, so rendering never meets a wrong type or an absurd number.
    """
    doc = read_json(path, max_bytes=MAX_BYTES, max_depth=MAX_DEPTH)
    if doc is None:
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise Untrusted(f"{path}: not a schema-{SCHEMA} state file")
    try:
        validate_state(doc)
    except Untrusted as exc:
        raise Untrusted(f"{path}: {exc}") from None
    return doc


def validate_state(doc: dict[str, Any]) -> None:
    sup = mapping(doc.get("supervisor"), "supervisor")
    integer(sup.get("pid"), "supervisor.pid", hi=PID_MAX)
    number(sup.get("start_time"), "supervisor.start_time")
    string(sup.get("version"), "supervisor.version", longest=200)
    string(sup.get("config"), "supervisor.config")
    phase = doc.get("phase")
    if phase is not None and phase not in PHASES:
        raise Untrusted(f"phase: {escape_unprintable(phase)[:40]!r} is not one of {', '.join(PHASES)}")
    string(doc.get("status"), "status")
    for name in TIMES:
        number(doc.get(name), name)
    integer(doc.get("exit_code"), "exit_code", lo=-255, hi=255)
    loading = mapping(doc.get("loading"), "loading")
    string(loading.get("phase"), "loading.phase")
    integer(loading.get("shards_done"), "loading.shards_done")
    integer(loading.get("shards_total"), "loading.shards_total")
    number(loading.get("percent"), "loading.percent", hi=100)
    number(loading.get("elapsed_s"), "loading.elapsed_s")
    number(loading.get("eta_s"), "loading.eta_s")
    string(loading.get("eta_basis"), "loading.eta_basis")
    pids: set[int] = set()
    for i, raw in enumerate(items(doc.get("processes"), "processes")):
        proc = mapping(raw, f"processes[{i}]", optional=False)
        integer(proc.get("pid"), f"processes[{i}].pid", optional=False, hi=PID_MAX)
        integer(proc.get("ppid"), f"processes[{i}].ppid", hi=PID_MAX)
        string(proc.get("label"), f"processes[{i}].label", optional=False, longest=200)
        pid = cast(int, proc["pid"])  # checked just above
        if pid in pids:  # a tree with a PID twice could be walked in a cycle
            raise Untrusted(f"processes[{i}].pid: {pid} listed twice")
        pids.add(pid)
        for j, gpu in enumerate(items(proc.get("gpus"), f"processes[{i}].gpus", longest=64)):
            g = mapping(gpu, f"processes[{i}].gpus[{j}]", optional=False)
            integer(g.get("index"), f"processes[{i}].gpus[{j}].index", optional=False)
            integer(g.get("used_mib"), f"processes[{i}].gpus[{j}].used_mib")
    for i, gpu in enumerate(items(doc.get("gpus"), "gpus", longest=64)):
        g = mapping(gpu, f"gpus[{i}]", optional=False)
        integer(g.get("index"), f"gpus[{i}].index", optional=False)
        integer(g.get("used_mib"), f"gpus[{i}].used_mib")
        integer(g.get("total_mib"), f"gpus[{i}].total_mib")
    string(doc.get("gpu_error"), "gpu_error")
    health = mapping(doc.get("health"), "health")
    boolean(health.get("ok"), "health.ok")
    number(health.get("latency_s"), "health.latency_s", optional=health.get("ok") is not True)
    number(health.get("at"), "health.at")
    string(health.get("error"), "health.error")
    integer(health.get("consecutive_failures"), "health.consecutive_failures")
    canary = mapping(doc.get("canary"), "canary")
    boolean(canary.get("ok"), "canary.ok")
    number(canary.get("latency_s"), "canary.latency_s", optional=canary.get("ok") is None)
    number(canary.get("at"), "canary.at")
    wd = mapping(doc.get("watchdog"), "watchdog")
    boolean(wd.get("enabled"), "watchdog.enabled")
    number(wd.get("interval_s"), "watchdog.interval_s", optional=not wd.get("enabled"))
    number(wd.get("last_ping_at"), "watchdog.last_ping_at")
    integer(wd.get("pings"), "watchdog.pings")
    weights = mapping(doc.get("weights"), "weights")
    string(weights.get("role"), "weights.role", longest=20)
    string(weights.get("health_url"), "weights.health_url")
    string(weights.get("socket_dir"), "weights.socket_dir")
    string(weights.get("holder_state"), "weights.holder_state")
    integer(weights.get("child_uid"), "weights.child_uid", hi=2**32 - 1)  # the engine compares it (holderwait.py)
    string(weights.get("child_user"), "weights.child_user", longest=256)
    for name, value in mapping(weights.get("key"), "weights.key").items():
        string(value, f"weights.key.{escape_unprintable(name)[:40]}")
    held = mapping(weights.get("checkpoint"), "weights.checkpoint")
    string(held.get("digest"), "weights.checkpoint.digest", optional=not held, longest=128)
    for name, value in mapping(held.get("shards"), "weights.checkpoint.shards").items():
        string(value, f"weights.checkpoint.shards.{escape_unprintable(name)[:40]}", optional=False, longest=128)
    _validate_front(mapping(doc.get("front"), "front"))
    failure = mapping(doc.get("last_failure"), "last_failure")
    number(failure.get("at"), "last_failure.at")
    integer(failure.get("exit_code"), "last_failure.exit_code", lo=-255, hi=255)
    string(failure.get("root_cause"), "last_failure.root_cause")
    string(failure.get("incident"), "last_failure.incident", longest=4096)


OUTAGE_COUNTS = ("held", "retried", "resumed", "failed")
OUTCOME_WORD = re.compile(r"[a-z_]{1,40}")


def _validate_front(front: dict[str, object]) -> None:
    """The front's numbers (deployment/front/watch.py writes them): its file is written by the account that parses
    every client's request, and root's `status` renders it, so it is checked like the engine's own."""
    boolean(front.get("engine_serving"), "front.engine_serving")
    integer(front.get("held"), "front.held")
    number(front.get("hold_s"), "front.hold_s")
    for outcome, count in mapping(front.get("requests"), "front.requests").items():
        where = f"front.requests.{escape_unprintable(outcome)[:40]}"
        if not OUTCOME_WORD.fullmatch(outcome):  # a key `--json` passes on: the front's outcomes are words
            raise Untrusted(f"{where}: not an outcome's name (lowercase letters and _, at most 40)")
        integer(count, where, optional=False)
    for i, raw in enumerate(items(front.get("outages"), "front.outages", longest=64)):
        outage = mapping(raw, f"front.outages[{i}]", optional=False)
        number(outage.get("began"), f"front.outages[{i}].began")
        number(outage.get("ended"), f"front.outages[{i}].ended")
        number(outage.get("client_wait_s"), f"front.outages[{i}].client_wait_s")
        for name in OUTAGE_COUNTS:
            integer(outage.get(name), f"front.outages[{i}].{name}")
        string(outage.get("kind"), f"front.outages[{i}].kind", longest=40)
        integer(outage.get("engine_exit_code"), f"front.outages[{i}].engine_exit_code", lo=-255, hi=255)
        boolean(outage.get("holder_assisted"), f"front.outages[{i}].holder_assisted")
    string(front.get("serving_engine"), "front.serving_engine", longest=40)
    spare = mapping(front.get("spare"), "front.spare")
    for flag in ("configured", "ready"):
        boolean(spare.get(flag), f"front.spare.{flag}")
    number(spare.get("without_ready_s"), "front.spare.without_ready_s")
    number(spare.get("alert_s"), "front.spare.alert_s")
    for i, raw in enumerate(items(spare.get("failovers"), "front.spare.failovers", longest=64)):
        failover = mapping(raw, f"front.spare.failovers[{i}]", optional=False)
        for key in ("at", "first_request_s"):
            number(failover.get(key), f"front.spare.failovers[{i}].{key}")
        for key in ("died", "to"):
            string(failover.get(key), f"front.spare.failovers[{i}].{key}", longest=40)


def writer_alive(doc: dict[str, Any]) -> bool:
    """True while the supervisor that wrote `doc` still runs (same PID, same start time)."""
    sup = doc.get("supervisor") or {}
    pid, started = sup.get("pid"), sup.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= PID_MAX:
        return False
    if not isinstance(started, (int, float)) or not math.isfinite(started):
        return False
    # The identity every kill uses (host/procident.py): a second apart is another process in a PID namespace
    # that hands PIDs out again soon (a restarted container's supervisor), not a rounding error.
    return same_process(ProcIdent(pid, float(started)))


def read_live_state(path: Path) -> dict[str, Any] | None:
    """The document at `path` while its writer still runs; None when there is none, it is not a state file, or its
    writer is gone (a dead supervisor's phase is history, not its process's state now)."""
    try:
        doc = read_state(path)
    except (OSError, Untrusted):
        return None
    return doc if doc is not None and writer_alive(doc) else None
