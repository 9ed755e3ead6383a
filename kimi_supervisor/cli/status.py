"""`kimi-supervisor status [--json] [--watch]`: what the service is doing, read from its files.

Reads the daemon's state file and the run history, nothing else: no root, no
NVML, no signal to the daemon, and safe while it runs.  Says plainly when
the daemon does not run: no state file, or one whose writer is gone (same
PID *and* start time, so a recycled PID does not pass for the supervisor).
Exit status as `systemctl status`: 0 while it runs, 3 when it does not, 4 for a NAME no deployment has
(LSB's "program or service status is unknown").  `--json` is always an array of deployment objects.

A host may run several deployments (config/layout.py: each its own state file and history).  Without
`--config` and NAME, `status` looks at every config in /etc/kimi-supervisor/ and every deployment with a
state file under the runtime directory (started from a config elsewhere): one shows in full as before;
several are listed one line each (`status NAME` then shows one), 0 only when all of them run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil

from kimi_supervisor.clock import format_duration
from kimi_supervisor.config import layout
from kimi_supervisor.config.layout import DeploymentDirectories
from kimi_supervisor.config.load import DEFAULT_PATH, load_config
from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.deployment.group.view import fetch as fetch_group
from kimi_supervisor.deployment.group.view import group_lines
from kimi_supervisor.exitcodes import ConfigError, DeploymentUnknown, ExitCode
from kimi_supervisor.opsview.history import HistoryData, RunRecord, load_history
from kimi_supervisor.opsview.loadreport import describe as describe_load
from kimi_supervisor.opsview.statefile import read_state, writer_alive
from kimi_supervisor.quoting import escape_unprintable
from kimi_supervisor.roles import Role

RUNS_SHOWN = 5
# [paths]' defaults (config/load.py): where a deployment without a config in /etc/kimi-supervisor has its files.
DEFAULT_RUNTIME_DIR = Path("/run/kimi-supervisor")
DEFAULT_STATE_DIR = Path("/var/lib/kimi-supervisor")
BAR_WIDTH = 24
_COLORS = {"green": "\x1b[32m", "yellow": "\x1b[33m", "red": "\x1b[31m", "bold": "\x1b[1m", "dim": "\x1b[2m"}
_RESET = "\x1b[0m"


@dataclasses.dataclass
class Snapshot:
    name: str  # the deployment's
    running: bool
    reason: str  # why (not) running, in words
    state: dict[str, Any] | None
    state_path: Path
    history: HistoryData
    history_path: Path
    note: str | None = None  # an unreadable state file or history
    role: Role = Role.ENGINE  # a deployment's weight holder has files of its own (config/layout.py)


def gather(dirs: DeploymentDirectories) -> Snapshot:
    state_path = dirs.state_file
    history_path = dirs.history_file
    name = dirs.name
    notes: list[str] = []
    history = _read_history(history_path, notes)
    try:
        state = read_state(state_path)
    except (OSError, ValueError) as exc:
        notes.append(f"state file unreadable: {exc}")
        state = None
    if state is None:
        reason = f"no state file at {state_path}" if not notes else "state file unreadable"
        return Snapshot(
            name, False, reason, None, state_path, history, history_path, "; ".join(notes) or None, dirs.role
        )
    pid = (state.get("supervisor") or {}).get("pid")
    phase = state.get("phase", "?")
    if writer_alive(state):
        note = "; ".join(notes) or None
        return Snapshot(name, True, f"PID {pid}", state, state_path, history, history_path, note, dirs.role)
    if phase in ("stopped", "failed"):
        reason = f"{phase} at {_when(state.get('ended_at'))}, exit {state.get('exit_code')}"
    else:
        reason = (
            f"supervisor PID {pid} is gone without a final state (killed?); "
            f"it was {phase} at {_when(state.get('updated_at'))}"
        )
    return Snapshot(name, False, reason, state, state_path, history, history_path, "; ".join(notes) or None, dirs.role)


def _read_history(path: Path, notes: list[str]) -> HistoryData:
    class _Notes:
        def warning(self, event: str, **fields: Any) -> None:
            notes.append(f"history {event.split('.')[-1]}: {fields.get('error')}")

    # A reader never renames the file (it may not even be allowed to): the daemon sets it aside.
    return load_history(path, _Notes(), set_aside=False)


# -- JSON --------------------------------------------------------------------------


def to_json(snap: Snapshot) -> dict[str, Any]:
    return {
        "deployment": snap.name,
        "running": snap.running,
        "reason": snap.reason,
        "state_file": str(snap.state_path),
        "state": snap.state,
        "history_file": str(snap.history_path),
        "counters": snap.history.counters,
        "runs": [dataclasses.asdict(r) for r in reversed(snap.history.runs)],
        "note": snap.note,
    }


# -- text --------------------------------------------------------------------------


def _when(ts: object, zone: bool = True) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" + (" UTC" if zone else ""), time.gmtime(ts))


def _ago(ts: object, now: float) -> str:
    return f"{format_duration(now - ts)} ago" if isinstance(ts, (int, float)) else "never"


def render_text(snap: Snapshot, now: float, color: bool = False) -> str:
    def c(text: str, name: str) -> str:
        return f"{_COLORS[name]}{text}{_RESET}" if color else text

    # Every string from the files is escaped before it reaches the terminal (vLLM's output lands in the
    # root cause, STATUS= and process titles): an ESC sequence there would act on the operator's terminal.
    s: dict[str, Any] = _escaped(snap.state or {})
    phase = s.get("phase", "?")
    lines: list[str] = []
    title = layout.unit_name(snap.name, snap.role)
    if snap.running:
        dot = c("●", {"ready": "green", "failed": "red"}.get(phase, "yellow"))
        lines.append(f"{dot} {title} - {s.get('status') or phase}")
        lines.append(f"{'Phase':>12}: {c(phase, 'bold')} since {_when(s.get('since'))}; {_ago(s.get('since'), now)}")
        lines += _progress(s, c)
        sup = s.get("supervisor") or {}
        lines.append(f"{'Main PID':>12}: {sup.get('pid')} (kimi-supervisor {sup.get('version')})")
        lines.append(f"{'Config':>12}: {sup.get('config')}")
        lines += _tree(s.get("processes") or [])
        lines += _gpus(s)
        lines += [] if "front" in s else _probes(s, now, c)  # a front probes its engine: its Front line says so
        lines += _uptime(s, now)
    else:
        dot = c("×", "red") if phase == "failed" else "○"
        lines.append(f"{dot} {title} - not running ({escape_unprintable(snap.reason)})")
    failure = s.get("last_failure") if s else _failure_from(snap.history)
    if failure:
        what = f"exit {failure.get('exit_code')} at {_when(failure.get('at'))}: {_cut(failure.get('root_cause'), 160)}"
        lines.append(f"{'Last failure':>12}: " + c(what, "red"))
        incident = failure.get("incident")
        if isinstance(incident, str) and incident:
            lines.append(f"{'Incident':>12}: {escape_unprintable(incident)} (stacks, GPUs, /metrics before the stop)")
    last = snap.history.last_successful_load()
    breakdown = describe_load(last) if last else None
    if breakdown:
        lines.append(f"{'Last load':>12}: {escape_unprintable(breakdown)}")
    if snap.note:
        lines.append(f"{'Note':>12}: {escape_unprintable(snap.note)}")
    if "front" in s:  # a front's own state file: no run history is kept, what it recorded is its outages
        lines.append(render_front(snap, now).rstrip("\n"))
    else:
        lines += _runs(snap.history, now)
    return "\n".join(lines) + "\n"


def holder_of(dirs: DeploymentDirectories) -> DeploymentDirectories | None:
    """The weight holder's files, when the deployment has one (docs/weight-holder.md): its state file or history."""
    return _beside(dirs, Role.WEIGHTS)


def front_of(dirs: DeploymentDirectories) -> DeploymentDirectories | None:
    """The front's files, when the deployment has one (docs/front.md): its state file."""
    return _beside(dirs, Role.FRONT)


def spare_of(dirs: DeploymentDirectories) -> DeploymentDirectories | None:
    """The hot spare's files, when the deployment has one (docs/spare.md): its state file or history."""
    return _beside(dirs, Role.SPARE)


def render_spare(spare: Snapshot) -> str:
    """The spare supervisor's own line: its phase and headline, as its state file says (docs/spare.md)."""
    state = spare.state or {}
    phase = state.get("phase") if spare.running else "not running"
    said = f", {escape_unprintable(str(state.get('status')))}" if spare.running and state.get("status") else ""
    return f"{'Spare':>12}: {escape_unprintable(str(phase))}{said}\n"


def _beside(dirs: DeploymentDirectories, role: Role) -> DeploymentDirectories | None:
    # role branch: status reads files, not a config (no deployment/ object): only an engine's files name the
    # supervisors beside it (its weight holder, its front)
    if dirs.role is not Role.ENGINE:
        return None
    other = dataclasses.replace(dirs, role=role)
    return other if other.state_file.exists() or other.history_file.exists() else None


def front_summary(front: Snapshot) -> dict[str, Any]:
    """What the front saw of the engine's restarts: its requests by outcome, and per outage (newest last) how
    long it lasted, the seconds clients waited, and the requests held, retried, resumed and failed.  Its state
    file was checked when read (statefile.py); one that failed the check is `note`, and nothing of it is shown."""
    s = (front.state or {}).get("front") or {}
    return {
        "phase": (front.state or {}).get("phase") if front.running else "not running",
        "engine_serving": s.get("engine_serving") if front.running else None,
        "held_now": s.get("held") if front.running else None,
        "requests": s.get("requests") or {},
        "outages": s.get("outages") or [],
        "note": front.note,
        # docs/spare.md: which engine new requests go to, and the hot spare's readiness and failovers.
        "serving_engine": s.get("serving_engine") if front.running else None,
        "spare": s.get("spare") if isinstance(s.get("spare"), dict) else None,
    }


def render_front(front: Snapshot, now: float) -> str:
    """One line; every value in it escaped (the front's account writes the file root's terminal shows)."""
    summary = front_summary(front)

    def shown(value: object) -> str:
        return escape_unprintable(str(value))

    line = f"{'Front':>12}: {shown(summary['phase'])}"
    if front.running:
        serving = "serving" if summary["engine_serving"] else "not serving"
        line += f", engine {serving}, {shown(summary['held_now'])} held now"
    spare = summary["spare"]
    if front.running and isinstance(spare, dict) and spare.get("configured"):
        target = summary["serving_engine"]
        ready = (
            "spare ready"
            if spare.get("ready")
            else f"no ready spare for {float(spare.get('without_ready_s') or 0):.0f}s"
        )
        line += f", new requests to {shown(target) if target else 'none'}, {ready}"
        failovers = [f for f in spare.get("failovers") or [] if isinstance(f, dict)]
        if failovers:
            took = failovers[-1].get("first_request_s")
            took_s = f"{took:.2f}s" if isinstance(took, (int, float)) else "?"
            line += f", {len(failovers)} failover(s), the last {took_s} from the death to the first request"
    outages = [o for o in summary["outages"] if isinstance(o, dict)]
    if outages:
        last = outages[-1]
        began, ended = last.get("began"), last.get("ended")
        took = f"{ended - began:.1f}s" if isinstance(began, (int, float)) and isinstance(ended, (int, float)) else "on"
        kind = last.get("kind")
        if isinstance(kind, str):  # docs/front.md: how the engine's run ended, from its history
            took += f" ({shown(kind)}{', holder-assisted' if last.get('holder_assisted') is True else ''})"
        waited = last.get("client_wait_s")
        line += (
            f"; {len(outages)} outage(s), the last {took}: clients waited "
            f"{float(waited) if isinstance(waited, (int, float)) else 0.0:.1f}s,"
            + ",".join(f" {name} {shown(last.get(name))}" for name in ("held", "retried", "resumed", "failed"))
        )
    if front.note:
        line += f" ({shown(front.note)})"
    return line + "\n"


def holder_summary(holder: Snapshot, engine: Snapshot, now: float) -> dict[str, Any]:
    """What the holder holds per GPU (its processes' NVML memory), how long it has been ready, and how many engine
    starts it served: the engine's runs that became ready while this holder was (with `"fallback": false` an
    engine is ready only on the held weights)."""
    s = holder.state or {}
    mib: dict[str, int] = {}
    for proc in s.get("processes") or []:
        for gpu in proc.get("gpus") or []:
            if isinstance(gpu.get("used_mib"), int):
                key = str(gpu.get("index"))
                mib[key] = mib.get(key, 0) + gpu["used_mib"]
    ready = s.get("ready_at") if holder.running else None
    served = None
    if isinstance(ready, (int, float)):
        served = sum(1 for r in engine.history.runs if r.ready is not None and r.ready >= ready)
    return {
        "phase": s.get("phase") if holder.running else "not running",
        "mib_by_gpu": mib,
        "ready_for_s": now - ready if isinstance(ready, (int, float)) else None,
        "loads_served": served,
    }


def render_holder(holder: Snapshot, engine: Snapshot, now: float, color: bool = False) -> str:
    summary = holder_summary(holder, engine, now)
    memory = ", ".join(f"GPU {g}: {m} MiB" for g, m in sorted(summary["mib_by_gpu"].items())) or "none listed"
    up = summary["ready_for_s"]
    line = f"{'Weights':>12}: holder {escape_unprintable(str(summary['phase']))}"
    if up is not None:
        line += f", ready for {format_duration(up)}, {summary['loads_served']} engine load(s) served"
    line += f"; holds {memory}"
    return "\n" + render_text(holder, now, color) + line + "\n"


def render_line(snap: Snapshot, color: bool = False) -> str:
    """One deployment in one line, for a host that runs several."""
    s: dict[str, Any] = _escaped(snap.state or {})
    phase = s.get("phase", "?")
    if snap.running:
        dot = f"{_COLORS[{'ready': 'green'}.get(phase, 'yellow')]}●{_RESET}" if color else "●"
        sup = s.get("supervisor") or {}
        what = f"{_cut(s.get('status') or phase, 100)} (PID {sup.get('pid')})"
    else:
        dot = "×" if phase == "failed" else "○"
        what = f"not running ({_cut(escape_unprintable(snap.reason), 100)})"
    return f"{dot} {escape_unprintable(snap.name):<24} {what}\n"


def _progress(s: dict[str, Any], c: Callable[[str, str], str]) -> list[str]:
    loading = s.get("loading")
    if not loading or s.get("phase") != "starting":
        return []
    parts = []
    if loading.get("percent") is not None:
        filled = round(BAR_WIDTH * loading["percent"] / 100)
        bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
        done, total = loading.get("shards_done"), loading.get("shards_total")
        parts.append(f"{c(bar, 'bold')} {loading['percent']}% {done}/{total} shards")
    else:
        parts.append(loading.get("phase") or "starting")
    parts.append(f"{format_duration(loading.get('elapsed_s') or 0)} elapsed")
    if loading.get("eta_s") is not None:
        parts.append(f"~{format_duration(loading['eta_s'])} left ({loading.get('eta_basis')})")
    else:
        parts.append("no ETA yet (no earlier load to go by)")
    return [f"{'Progress':>12}: " + ", ".join(parts)]


def _tree(procs: list[dict[str, Any]]) -> list[str]:
    if not procs:
        return []
    pids = {p["pid"] for p in procs}
    children: dict[int | None, list[dict[str, Any]]] = {}
    for p in procs:
        children.setdefault(p.get("ppid") if p.get("ppid") in pids else None, []).append(p)
    out: list[str] = []
    shown: set[int] = set()  # a PID that is its own ancestor (a hand-made file) is drawn once

    def label(p: dict[str, Any]) -> str:
        gpus = ", ".join(f"GPU {g.get('index')}: {_mib(g.get('used_mib'))} MiB" for g in p.get("gpus") or [])
        return f"{p['pid']} {p['label']}" + (f"  {gpus}" if gpus else "")

    def walk(pid: int, prefix: str) -> None:
        if pid in shown or len(prefix) > 64:
            return
        shown.add(pid)
        kids = children.get(pid, [])
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            out.append(f"{prefix}{'└─' if last else '├─'}{label(kid)}")
            walk(kid["pid"], prefix + ("  " if last else "│ "))

    for top in children.get(None, []):
        out.append(label(top))
        walk(top["pid"], "")
    return [f"{'Tree' if i == 0 else '':>12}{':' if i == 0 else ' '} {line}" for i, line in enumerate(out)]


def _mib(value: object) -> str:
    return str(value) if value is not None else "?"


def _gpus(s: dict[str, Any]) -> list[str]:
    if s.get("gpu_error"):
        return [f"{'GPUs':>12}: unknown ({s['gpu_error']})"]
    gpus = s.get("gpus") or []
    if not gpus:
        return []
    return [
        f"{'GPUs':>12}: " + ", ".join(f"{g.get('index')}: {g.get('used_mib')}/{g.get('total_mib')} MiB" for g in gpus)
    ]


def _probes(s: dict[str, Any], now: float, c: Callable[[str, str], str]) -> list[str]:
    lines = []
    h = s.get("health") or {}
    if h.get("ok") is None:
        text = "not probed yet"
    elif h["ok"]:
        text = c("ok", "green") + f", {h['latency_s'] * 1000:.1f} ms, {_ago(h.get('at'), now)}"
    elif s.get("phase") in ("preflight", "starting"):
        text = f"not answering yet ({h.get('error')}), last probe {_ago(h.get('at'), now)}"
    else:
        text = c(f"failing ({h.get('error')})", "red") + f", {h.get('consecutive_failures')} in a row"
        text += f", last {_ago(h.get('at'), now)}"
    lines.append(f"{'Health':>12}: {text}")
    can = s.get("canary") or {}
    if can.get("ok") is not None:
        verdict = c("ok", "green") if can["ok"] else c("failed", "red")
        lines.append(f"{'Canary':>12}: {verdict}, {can['latency_s'] * 1000:.0f} ms, {_ago(can.get('at'), now)}")
    wd = s.get("watchdog") or {}
    if not wd.get("enabled"):
        text = "off (no WatchdogSec)"
    elif wd.get("last_ping_at") is None:
        text = f"every {format_duration(wd['interval_s'])}, no ping yet (pings start at READY)"
    else:
        since = now - wd["last_ping_at"]
        late = since > wd["interval_s"] / 2 + 5
        text = f"every {format_duration(wd['interval_s'])}, last ping {format_duration(since)} ago"
        text = c(text + " (NOT pinging: health failing?)", "red") if late else text
    lines.append(f"{'Watchdog':>12}: {text}")
    return lines


def _uptime(s: dict[str, Any], now: float) -> list[str]:
    started, ready, spawned = s.get("started_at"), s.get("ready_at"), s.get("spawned_at")
    if isinstance(ready, (int, float)):
        load = f", load took {format_duration(ready - spawned)}" if isinstance(spawned, (int, float)) else ""
        return [f"{'Uptime':>12}: ready for {format_duration(now - ready)}{load}"]
    if isinstance(started, (int, float)):
        return [f"{'Uptime':>12}: not ready yet; supervisor up {format_duration(now - started)}"]
    return []


def _failure_from(history: HistoryData) -> dict[str, Any] | None:
    for run in reversed(history.runs):
        if run.exit_code not in (None, 0) or run.root_cause:
            cause = escape_unprintable(run.root_cause or "")
            failure = {"at": run.end, "exit_code": run.exit_code, "root_cause": cause}
            return {**failure, "incident": run.incident} if run.incident else failure
    return None


def _runs(history: HistoryData, now: float) -> list[str]:
    if not history.runs:
        return ["", "No runs recorded yet."]
    starts = history.counters.get("starts_total", len(history.runs))
    shown = list(reversed(history.runs))[:RUNS_SHOWN]
    title = "Last run" if len(shown) == 1 else f"Last {len(shown)} runs, newest first"
    lines = ["", f"{title} ({starts} start{'s' if starts != 1 else ''} recorded):"]
    lines.append(f"  {'started (UTC)':<19}  {'load':>6}  {'ended (UTC)':<19}  {'exit':>4}  cause")
    for r in shown:
        lines.append(f"  {_when(r.start, False):<19}  {_load(r):>6}  {_ended(r):<19}  {_exit(r):>4}  {_cause(r)}")
    return lines


def _load(r: RunRecord) -> str:
    return format_duration(r.load_s) if r.load_s is not None else "-"


def _ended(r: RunRecord) -> str:
    return _when(r.end, False) if r.end is not None else ("-" if r.unfinished else "?")


def _exit(r: RunRecord) -> str:
    return str(r.exit_code) if r.exit_code is not None else ("-" if r.unfinished else "?")


def _cause(r: RunRecord) -> str:
    if r.unfinished:
        return "(running)"
    if r.exit_code == 0:
        return "stopped on request"
    return _cut(escape_unprintable(r.root_cause or ""), 80)


def _escaped(value: Any) -> Any:
    """A copy of a JSON value with every string (keys too) made printable."""
    if isinstance(value, str):
        return escape_unprintable(value)
    if isinstance(value, dict):
        return {escape_unprintable(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def _cut(text: object, width: int) -> str:
    """One report line stays readable; `--json` has the whole text."""
    text = str(text or "")
    return text if len(text) <= width else text[: width - 1] + "…"


# -- the command -------------------------------------------------------------------


def deployment_of(config: Path, err: TextIO) -> DeploymentDirectories:
    """The deployment's directories; the default paths (with a note) when the config cannot be read (a
    non-root `status` cannot read a 0600 config: the name then is the file's stem, as the default is)."""
    try:
        return layout.of(load_config(config))
    except ConfigError as exc:
        from kimi_supervisor.config.load import parse_config

        print(f"kimi-supervisor: {exc.message}; using the default paths", file=err)
        return layout.of(parse_config({"child": {"argv": ["vllm"]}}, config))


def deployments(
    config_dir: Path, err: TextIO, runtime_dirs: tuple[Path, ...] = (), running: Sequence[Path] = ()
) -> list[DeploymentDirectories]:
    """Every deployment configured in `config_dir` (one `NAME.toml` each, beside it its holder's and front's), every
    one whose supervisor runs from a config in `running` (running_configs: one elsewhere, with its own [paths]),
    and every one with a state file under a runtime directory (theirs, and `runtime_dirs`)."""
    try:
        configs = sorted(p for p in config_dir.iterdir() if p.suffix == ".toml" and not p.name.startswith("."))
    except OSError:
        configs = []
    found: dict[str, DeploymentDirectories] = {}
    for config in configs:
        _add(found, deployment_of(config, err))
    for config in running:
        try:
            dirs = layout.of(load_config(config))
        except ConfigError:
            continue  # not readable by this user: its state may still be found under a runtime directory
        _add(found, dirs)
    for root in sorted({*runtime_dirs, *(d.locks for d in found.values())}):
        for dirs in _running_under(root, set(found), err):
            found[dirs.name] = dirs
    return [found[name] for name in sorted(found)]


def _add(found: dict[str, DeploymentDirectories], dirs: DeploymentDirectories) -> None:
    # A deployment is shown as its engine's files, its holder's and front's beside them (holder_of, front_of):
    # NAME.front.toml sorts before NAME.toml and is deployment NAME too.
    have = found.get(dirs.name)
    if have is None or (have.role.beside_engine and not dirs.role.beside_engine):
        found[dirs.name] = dirs


def running_configs() -> list[Path]:
    """The config of every kimi-supervisor run on this host, from the process table: a deployment started from a
    config outside the config directory with [paths] of its own (the demo's .demo-state/) keeps its state where
    neither the config directory nor the default runtime directory leads.  A process whose command line or working
    directory this user may not read is left out (its deployment is found by its state file, if at all)."""
    found: set[Path] = set()
    for proc in psutil.process_iter(["cmdline"]):
        config = run_config(proc.info["cmdline"] or [])
        if config is None:
            continue
        if not config.is_absolute():
            try:
                config = Path(proc.cwd()) / config
            except psutil.Error:
                continue
        found.add(config)
    return sorted(found)


def run_config(argv: Sequence[str]) -> Path | None:
    """The config of a kimi-supervisor run's command line (its console script, `python3 .../bin/kimi-supervisor`
    as its shebang runs it, or `python3 -m kimi_supervisor`); None for any other command, and for our own
    `status`, `check-config`, `install-unit` and `--dry-run`, which run nothing."""
    from kimi_supervisor.cli.args import parse_args

    words = list(argv)
    for i, word in enumerate(words[:3]):
        if os.path.basename(word) == "kimi-supervisor":
            rest = words[i + 1 :]
            break
        if word == "-m" and words[i + 1 : i + 2] == ["kimi_supervisor"]:
            rest = words[i + 2 :]
            break
    else:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a command line it cannot parse is not a run
            args = parse_args(rest)
    except SystemExit:
        return None
    return args.config if args.command == "run" and not args.dry_run else None


def _running_under(root: Path, known: set[str], err: TextIO) -> list[DeploymentDirectories]:
    """The deployments with a state file in `root` (config/layout.py: ROOT/NAME/state.json): each one's own
    directories from the config its state file names, else ROOT/NAME and the default state directory."""
    try:
        names = sorted(
            p.name for p in root.iterdir() if p.name not in known and (p / Role.ENGINE.state_file_name).is_file()
        )
    except OSError:
        return []
    out = []
    for name in names:
        try:
            state = read_state(root / name / Role.ENGINE.state_file_name) or {}
        except (OSError, ValueError):
            state = {}
        config = (state.get("supervisor") or {}).get("config")
        dirs = deployment_of(Path(config), err) if isinstance(config, str) and os.path.isfile(config) else None
        if dirs is None or dirs.name != name or dirs.locks != root:
            # Its history: where the default [paths] put it, if its runtime directory is the default one too;
            # else unknown (none shown), never another deployment's.
            history = (DEFAULT_STATE_DIR if root == DEFAULT_RUNTIME_DIR else root) / name
            dirs = DeploymentDirectories(name, locks=root, runtime=root / name, state=history)
        out.append(dirs)
    return out


def select(
    config: Path | None,
    name: str | None,
    config_dir: Path,
    err: TextIO,
    runtime_dirs: tuple[Path, ...] = (),
    running: Sequence[Path] = (),
) -> list[DeploymentDirectories]:
    """What `status` shows: the one config given, the NAME asked for, or every deployment configured here or
    running (the default config's when there is none).  DeploymentUnknown (exit 4) for a NAME none of them has."""
    if config is not None:
        return [deployment_of(config, err)]
    found = deployments(config_dir, err, runtime_dirs, running)
    if name is not None:
        chosen = [d for d in found if d.name == name]
        if not chosen:
            known = ", ".join(d.name for d in found) or "none"
            raise DeploymentUnknown(f"status: no deployment named {name!r} in {config_dir} (configured: {known})")
        return chosen
    return found or [deployment_of(config_dir / DEFAULT_PATH.name, err)]


def _cluster_for(config: Path) -> ClusterConfig | None:
    try:
        return load_config(config).cluster
    except ConfigError:
        return None  # deployment_of said so already (or no config of that name: not a group node we know)


def run_status(
    config: Path | None,
    as_json: bool,
    watch: bool,
    out: TextIO | None = None,
    now: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    *,
    name: str | None = None,
    config_dir: Path = DEFAULT_PATH.parent,
    runtime_dirs: tuple[Path, ...] = (),
    running: Callable[[], Sequence[Path]] = tuple,
) -> int:
    """`running`: the configs of the supervisors running here (cli passes running_configs; a test its own)."""
    out = out or sys.stdout
    lookup = running() if config is None else ()
    chosen = select(config, name, config_dir, sys.stderr, runtime_dirs, lookup)
    tty = out.isatty()
    color = tty and not os.environ.get("NO_COLOR")
    if len(chosen) > 1:  # a host of several deployments: one line each (`status NAME` for one)
        snaps = [gather(d) for d in chosen]
        if as_json:
            out.write(json.dumps([to_json(snap) for snap in snaps], indent=2) + "\n")
        else:
            out.write("".join(render_line(snap, color) for snap in snaps))
        out.flush()
        return ExitCode.OK if all(snap.running for snap in snaps) else ExitCode.NOT_RUNNING
    [dirs] = chosen
    # A node of a multi-node group: its role, rank and peers as this node sees them (deployment/group/view.py).
    cluster = _cluster_for(config if config is not None else config_dir / f"{dirs.name}.toml")
    holder_dirs = holder_of(dirs)
    front_dirs = front_of(dirs)
    spare_dirs = spare_of(dirs)
    while True:
        snap = gather(dirs)
        group = fetch_group(cluster) if cluster is not None and snap.running else (None, "not running")
        if as_json:
            doc = to_json(snap) | ({"group": group[0], "group_error": group[1]} if cluster is not None else {})
            if holder_dirs is not None:
                held = gather(holder_dirs)
                doc["weights_holder"] = to_json(held) | {"summary": holder_summary(held, snap, now())}
            if front_dirs is not None:
                doc["front"] = front_summary(gather(front_dirs))
            if spare_dirs is not None:
                doc["spare"] = to_json(gather(spare_dirs))
            # One shape always: an array of deployment objects, one or several (docs/operators-view.md).
            out.write(json.dumps([doc], indent=2) + "\n")
        else:
            if watch and tty:
                out.write("\x1b[H\x1b[2J")  # home and clear: redraw in place, like watch(1)
            out.write(render_text(snap, now(), color))
            if holder_dirs is not None:  # the deployment's weight holder, its own unit (docs/weight-holder.md)
                out.write(render_holder(gather(holder_dirs), snap, now(), color))
            if spare_dirs is not None:  # the deployment's hot spare, its own unit (docs/spare.md)
                out.write(render_spare(gather(spare_dirs)))
            if front_dirs is not None:  # the deployment's front, its own unit (docs/front.md)
                out.write(render_front(gather(front_dirs), now()))
            if cluster is not None:
                out.write("\n".join(group_lines(cluster, *group)) + "\n")
        out.flush()
        phase = (snap.state or {}).get("phase")
        if not watch or not snap.running or phase == "ready":
            return ExitCode.OK if snap.running else ExitCode.NOT_RUNNING
        if not tty:
            out.write("\n")
        sleep(1.0)
