"""A start refused before its run begins still leaves its mark where the operator looks (docs/operators-view.md).

The directory check (78), the instance lock (16, 77) come before `Supervisor` and its operator's view exist,
so such a start wrote nothing: after a stop the textfile went on saying `stopped` (which silences
KimiSupervisorNotServing) and the history did not grow (KimiSupervisorRestartingRepeatedly never fired).  Here
the same view records the start and its failure: the state file and the textfile say `failed` with the exit
code, the history gets a run (and `starts_total`, hence the restarts counter, grows).

Only where that clobbers nothing and trusts nothing it must not:
* the files are this deployment's only while no other supervisor holds its name's or its textfile's lock
  (`instance_lock.own_files`).  Exit 16 because this very deployment is running (a second start from a shell
  while the unit serves) leaves them to the running one: its `ready` stands, the refusal is in the journal.
  Exit 16 because another deployment holds a GPU or the port means this deployment is down: recorded;
* only in directories that pass the check a start needs (dirtrust): a runtime or state directory that fails
  it leaves nothing written (writing there is what the check refuses), a failing textfile directory leaves
  the textfile alone.  A config that cannot be parsed names no directory at all: the journal and the unit's
  `failed` state are all there is (docs/operators-view.md).
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config import layout
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import ConfigError, SupervisorError
from kimi_supervisor.files import dirtrust
from kimi_supervisor.host import instance_lock
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview.view import OperatorView
from kimi_supervisor.states import State


def _trusted(cfg: Config, *directories: tuple[Path, str]) -> bool:
    try:
        for directory, key in directories:
            dirtrust.check_directory(directory, key, cfg.path)
    except ConfigError:
        return False
    return True


# Why nothing was recorded is logged at debug only: a refused start says one line (its error names the directory,
# the lock or the running supervisor), never more.
def record_failed_start(
    cfg: Config, code: int, reason: str, probe: GpuProbe, log: Logger, resources: instance_lock.Resources
) -> bool:
    """Record a start that failed with `code` (`reason`: its one line, secrets redacted) as this deployment's
    start and failure; False (and why, logged) where it must not.  `resources`: its role's locks (of which
    its own files' alone are taken)."""
    own = layout.of(cfg)
    paths = cfg.paths
    ours = [
        (paths.runtime_directory, "paths.runtime_directory"),
        (own.runtime, "paths.runtime_directory"),
        (paths.state_directory, "paths.state_directory"),
        (own.state, "paths.state_directory"),
    ]
    if not _trusted(cfg, *ours):
        log.debug("start.unrecorded", exit_code=code, why="the runtime or state directory failed its check")
        return False
    try:
        guard = instance_lock.own_files(resources, log)
    except SupervisorError as exc:
        log.debug("start.unrecorded", exit_code=code, why=exc.message)
        return False
    if guard is None:
        log.debug(
            "start.unrecorded",
            exit_code=code,
            why="a running supervisor of this deployment holds its files; its state stands",
        )
        return False
    try:
        view = OperatorView(cfg, probe, log, ReadinessTracker(cfg.readiness), None)
        textfile = cfg.metrics.textfile
        if textfile is not None and not _trusted(cfg, (textfile.parent, "metrics.textfile")):
            view.metrics = None
        view.on_state(State.PREFLIGHT, "preflight", {})
        view.on_state(State.FAILED, f"failed: {reason}"[:400], {"exit_code": code})
    finally:
        guard.close()
    return True
