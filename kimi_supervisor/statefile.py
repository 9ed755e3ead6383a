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
from pathlib import Path
from typing import Any

import psutil

from kimi_supervisor.atomicfile import ensure_directory, write_atomic
from kimi_supervisor.boundaries import Logger

SCHEMA = 1
FILE_NAME = "state.json"
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
)


def process_start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class StateFile:
    """Writes the document; a failure is warned about once per outage and never raised (serving goes on)."""

    def __init__(self, directory: Path, log: Logger) -> None:
        self.path = directory / FILE_NAME
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


def read_state(path: Path) -> dict[str, Any] | None:
    """The document at `path`, or None when there is none; ValueError when it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a schema-{SCHEMA} state file")
    return doc


def writer_alive(doc: dict[str, Any]) -> bool:
    """True while the supervisor that wrote `doc` still runs (same PID, same start time)."""
    sup = doc.get("supervisor") or {}
    pid, started = sup.get("pid"), sup.get("start_time")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return False
    now_started = process_start_time(pid)
    return now_started is not None and abs(now_started - started) < 1.0
