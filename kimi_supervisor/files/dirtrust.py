"""The directories root writes its files in, checked before the run acts (docs/hardening.md).

`paths.runtime_directory` (instance locks) with the deployment's own directory below it (state.json),
`paths.state_directory` with the deployment's own below it (history.json; config/layout.py) and the
directory of `metrics.textfile` are checked like the config file's directories (config/file.py, sshd's
StrictModes), on the path as written *and* on the path it resolves to: every directory on the way is owned
by root (or the account the supervisor runs as) and not writable by group or others; a sticky directory
such as /tmp is allowed above ours but never as the one holding our files.  A symlink on the way is fine
when the directory holding it is (its owner decides where it points).  Anything else is a config error
naming the key, exit 78, before the preflight changes anything.  Each write checks its directory again
(atomicfile.write_atomic), so a directory loosened later is refused there with a warning.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kimi_supervisor.config import layout
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.files.atomic import directory_problem, ensure_directory


def _chain(path: Path) -> list[Path]:
    return [path, *path.parents]


def check_directory(path: Path, key: str, config: Path) -> None:
    """ConfigError unless every existing directory on `path` (as written and resolved) is one root may trust."""
    chains = [Path(os.path.abspath(path)), Path(os.path.realpath(path))]
    for chain in chains:
        for directory in _chain(chain):
            try:
                st = os.lstat(directory)
            except FileNotFoundError:
                continue  # created by us below an existing, checked directory
            except OSError as exc:
                raise ConfigError(f"{config}: {key}: cannot check directory {directory}: {exc.strerror}") from None
            if stat.S_ISLNK(st.st_mode):
                continue  # its parent, checked next, decides where it points
            problem = directory_problem(st, holds_our_files=directory == chain)
            if problem is not None:
                fix = "chmod go-w" if "writable" in problem else "chown root"
                raise ConfigError(
                    f"{config}: {key}: directory {directory}{'' if chain == chains[0] else f' (from {path})'} "
                    f"{problem}; refusing to write root's files there ({fix} {directory}, or pick another directory)"
                )


def prepare_directories(cfg: Config, *, create: bool = True) -> None:
    """Create the runtime and state directories and the deployment's own below them when missing (0755),
    then check them and the metrics one."""
    own = layout.of(cfg)
    wanted = [
        (cfg.paths.runtime_directory, "paths.runtime_directory", True),
        (own.runtime, "paths.runtime_directory", True),
        (cfg.paths.state_directory, "paths.state_directory", True),
        (own.state, "paths.state_directory", True),
    ]
    if cfg.metrics.textfile is not None:
        wanted.append((cfg.metrics.textfile.parent, "metrics.textfile", False))  # node_exporter's: not created
    for directory, key, ours in wanted:
        check_directory(directory, key, cfg.path)  # before creating anything below it
        if create and ours:
            try:
                ensure_directory(directory)
            except OSError as exc:
                raise ConfigError(f"{cfg.path}: {key}: cannot create {directory}: {exc.strerror}") from None
            check_directory(directory, key, cfg.path)  # a directory someone made first is caught here
