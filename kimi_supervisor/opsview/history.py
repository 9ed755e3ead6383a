"""The run history: the last runs, kept across restarts in the state directory.

One JSON document, rewritten atomically at each run's start, ready and end:

    {"schema": 1, "counters": {"starts_total": 7, ...}, "runs": [oldest, ..., newest]}

Each run: start, ready (wall-clock epoch seconds), load_s (spawn to ready),
post_weights_s (last shard loaded to ready: what the ETA adds after the
weights), end, exit_code, root_cause, incident (the evidence file of a stop the
supervisor decided on: opsview/forensics.py), and the start broken down (LOAD_FIELDS,
opsview/loadwatch.py): vLLM's phases, the checkpoint's size, the fraction the
page cache held before the spawn, and the bytes the child's tree read.  The counters are cumulative over every
run this directory has seen, so a Prometheus counter built from them does not
reset when systemd restarts the service.

A file that cannot be read as such a document is renamed `*.corrupt-<ts>` with
a warning and a new history begins: the history is for the operator, never a
reason not to serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

from kimi_supervisor.files.atomic import ensure_directory, write_atomic
from kimi_supervisor.files.untrusted import integer, number, read_capped, string
from kimi_supervisor.logs.types import Logger, Warns
from kimi_supervisor.opsview.statefile import PID_MAX
from kimi_supervisor.quoting import escape_unprintable
from kimi_supervisor.roles import Role
from kimi_supervisor.untrusted_json import parse_json

FILE_NAME = Role.ENGINE.history_file_name  # the engine's; another role's is named by config/layout.py
KEEP = 20
SCHEMA = 1
COUNTERS = ("starts_total", "preflight_kills_total", "shm_removed_total")
MAX_BYTES = 1 << 20  # 20 runs of a few hundred bytes each
MAX_DEPTH = 8  # the document nests 3 deep
UNRECORDED = "the supervisor ended without recording an exit (killed, or the host went down)"
LOAD_SECONDS = ("weights_s", "post_processing_s", "compile_s", "graphs_s", "init_engine_s")
LOAD_FIELDS = (*LOAD_SECONDS, "fs_type", "compile_cache", "checkpoint_bytes", "cached_fraction", "read_bytes")


@dataclasses.dataclass
class RunRecord:
    start: float
    pid: int
    ready: float | None = None
    load_s: float | None = None
    post_weights_s: float | None = None
    end: float | None = None
    exit_code: int | None = None
    root_cause: str | None = None
    fs_type: str | None = None  # vLLM's word: EXT4, NFS4, unknown
    weights_s: float | None = None
    post_processing_s: float | None = None
    compile_s: float | None = None
    compile_cache: str | None = None  # "hit" | "miss"
    graphs_s: float | None = None
    init_engine_s: float | None = None
    checkpoint_bytes: int | None = None
    cached_fraction: float | None = None
    read_bytes: int | None = None
    incident: str | None = None  # the incident file of a stop the supervisor decided on (forensics.py)

    @property
    def unfinished(self) -> bool:
        return self.end is None and self.root_cause is None

    @classmethod
    def from_dict(cls, raw: object) -> RunRecord:
        if not isinstance(raw, dict):
            raise ValueError(f"a run is not an object: {raw!r:.80}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(raw) - set(fields)
        if unknown:
            raise ValueError(f"unknown run fields {sorted(unknown)}")
        # Every field is range-checked: `status` renders them (a 1e300 timestamp has no calendar date).
        number(raw.get("start"), "run field 'start'", optional=False)
        integer(raw.get("pid"), "run field 'pid'", optional=False, hi=PID_MAX)
        for name in ("ready", "load_s", "post_weights_s", "end"):
            number(raw.get(name), f"run field {name!r}")
        integer(raw.get("exit_code"), "run field 'exit_code'", lo=-255, hi=255)
        cause = raw.get("root_cause")
        string(cause, "run field 'root_cause'")
        assert cause is None or isinstance(cause, str)
        for name in (*LOAD_SECONDS, "cached_fraction"):
            number(raw.get(name), f"run field {name!r}")
        for name in ("checkpoint_bytes", "read_bytes"):
            integer(raw.get(name), f"run field {name!r}", lo=0)
        if raw.get("compile_cache") not in (None, "hit", "miss"):
            raise ValueError(f"run field 'compile_cache' is not hit or miss: {raw.get('compile_cache')!r:.40}")
        fs = raw.get("fs_type")
        string(fs, "run field 'fs_type'")
        if isinstance(fs, str) and not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", fs):
            raise ValueError(f"run field 'fs_type' is not a file system type: {fs!r:.40}")
        record = cls(start=float(raw["start"]), pid=int(raw["pid"]))
        for name in ("ready", "load_s", "post_weights_s", "end", *LOAD_SECONDS, "cached_fraction"):
            if raw.get(name) is not None:
                setattr(record, name, float(raw[name]))
        for name in ("checkpoint_bytes", "read_bytes"):
            if raw.get(name) is not None:
                setattr(record, name, int(raw[name]))
        record.fs_type, record.compile_cache = fs, raw.get("compile_cache")
        record.exit_code = None if raw.get("exit_code") is None else int(raw["exit_code"])
        record.root_cause = cause
        incident = raw.get("incident")
        string(incident, "run field 'incident'", longest=4096)
        assert incident is None or isinstance(incident, str)
        record.incident = incident
        return record


@dataclasses.dataclass
class HistoryData:
    runs: list[RunRecord] = dataclasses.field(default_factory=list)
    counters: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def last_successful_load(self) -> RunRecord | None:
        """The newest run that became ready (its load time predicts the next one)."""
        return next((r for r in reversed(self.runs) if r.load_s is not None), None)


def parse_history(raw: bytes) -> HistoryData:
    """The document in `raw`; ValueError when it is not a history."""
    doc = parse_json(raw, MAX_DEPTH)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a schema-{SCHEMA} history document")
    runs_raw, counters_raw = doc.get("runs"), doc.get("counters", {})
    if not isinstance(runs_raw, list) or not isinstance(counters_raw, dict):
        raise ValueError("'runs' must be a list and 'counters' an object")
    counters = dict.fromkeys(COUNTERS, 0)
    for name, value in counters_raw.items():
        if name not in counters:
            raise ValueError(f"unknown counter {escape_unprintable(name)[:40]!r}")
        integer(value, f"counter {name!r}", optional=False)
        counters[name] = value
    return HistoryData([RunRecord.from_dict(r) for r in runs_raw][-KEEP:], counters)


def load_history(path: Path, log: Warns | None = None, set_aside: bool = True) -> HistoryData:
    """Read the history; a missing file is an empty history, a corrupt one is set aside (never raised)."""
    try:
        # Non-blocking, regular files only, capped (untrusted.py): a FIFO here once hung the daemon's start.
        raw = read_capped(path, MAX_BYTES)
        if raw is None:
            return HistoryData()
        return parse_history(raw)
    except OSError as exc:  # cannot tell (no permission): neither trusted nor set aside
        if log is not None:
            log.warning("history.unreadable", path=str(path), error=str(exc))
        return HistoryData()
    except (ValueError, TypeError) as exc:  # Untrusted, UnicodeDecodeError and json's errors are ValueErrors
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
        if set_aside:
            with contextlib.suppress(OSError):
                path.rename(aside)
        if log is not None:
            log.warning(
                "history.corrupt",
                path=str(path),
                set_aside_as=str(aside) if set_aside else None,
                error=str(exc)[:200],
                why="starting a new history; the old file is kept for inspection",
            )
        return HistoryData()


def dump_history(data: HistoryData) -> bytes:
    doc = {
        "schema": SCHEMA,
        "counters": data.counters,
        "runs": [dataclasses.asdict(r) for r in data.runs[-KEEP:]],
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


class History:
    """This run's view of the history file: begin, mark ready, end; every change saved at once."""

    def __init__(self, path: Path, log: Logger, pid: int) -> None:
        self.path = path
        self._log = log
        self._pid = pid
        self.data = HistoryData()
        self.current: RunRecord | None = None
        self._warned = False

    def begin(self, now: float) -> None:
        self.data = load_history(self.path, self._log)
        for run in self.data.runs:
            if run.unfinished:
                # A run that never recorded its end: its supervisor was SIGKILLed or the host died.
                run.root_cause = UNRECORDED
        self.current = RunRecord(start=now, pid=self._pid)
        self.data.runs = [*self.data.runs, self.current][-KEEP:]
        self.data.counters["starts_total"] += 1
        self.save()

    def count(self, name: str, n: int) -> None:
        if n:
            self.data.counters[name] += n
            self.save()

    def ready(self, now: float, load_s: float, post_weights_s: float | None) -> None:
        if self.current is None:
            return
        self.current.ready, self.current.load_s = now, round(load_s, 3)
        self.current.post_weights_s = None if post_weights_s is None else round(post_weights_s, 3)
        self.save()

    def load(self, fields: dict[str, Any]) -> None:
        """The start broken down (loadwatch.LoadWatch.record), saved with the run."""
        if self.current is None:
            return
        for name in LOAD_FIELDS:
            setattr(self.current, name, fields.get(name))
        self.save()

    def end(self, now: float, exit_code: int, root_cause: str | None, incident: str | None = None) -> None:
        if self.current is None:
            return
        self.current.end, self.current.exit_code, self.current.root_cause = now, exit_code, root_cause
        if incident is not None:  # None leaves an earlier one (the watchdog's) in place
            self.current.incident = incident
        self.save()

    def incident(self, path: str | None) -> None:
        """An incident file named while the run goes on (the watchdog's coming kill)."""
        if self.current is not None and path is not None:
            self.current.incident = path
            self.save()

    def save(self) -> None:
        try:
            ensure_directory(self.path.parent)
            write_atomic(self.path, dump_history(self.data))
            self._warned = False
        except OSError as exc:
            if not self._warned:  # once per outage, not every save
                self._log.warning("history.unwritable", path=str(self.path), error=str(exc), why="serving goes on")
                self._warned = True
