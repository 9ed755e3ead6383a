"""Where one deployment's files live on a host that may run several (docs/configuration.md, several deployments).

GPUs and ports are host-wide, so every deployment's instance locks sit in one directory, the configured
`paths.runtime_directory` itself.  What is a deployment's own goes in a directory named after it
(`deployment.name`, by default the config file's stem) below the configured ones, so two deployments with
the default `[paths]` never share a file:

    /run/kimi-supervisor/gpu-0.lock, port-8000.lock, deployment-NAME.lock    the host's locks
    /run/kimi-supervisor/NAME/state.json                                     NAME's live state
    /var/lib/kimi-supervisor/NAME/history.json                               NAME's run history
    /run/kimi-supervisor/NAME/state.weights.json, weight-cache/               NAME's holder (docs/weight-holder.md)
    /var/lib/kimi-supervisor/NAME/history.weights.json

A deployment's weight holder (role "weights", `vllm preload`) is a second supervisor of the same deployment:
its files carry the role's suffix beside the engine's, in the same directories, so each one's state is its own
and the engine reads the holder's from where it knows to look.

Two configs of one name would share these directories: the instance lock refuses the second
(`deployment-NAME.lock`, exit 16).  Under the template unit `kimi-supervisor@NAME.service` the two
directories are its `RuntimeDirectory=kimi-supervisor/%i` and `StateDirectory=kimi-supervisor/%i`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kimi_supervisor.config import role_spec
from kimi_supervisor.config.model import Config, PathsConfig
from kimi_supervisor.roles import Role

PLAIN = "kimi-supervisor"  # the plain unit's name, and its deployment's (the default config's stem)


@dataclasses.dataclass(frozen=True)
class DeploymentDirectories:
    name: str
    locks: Path  # host-wide: the instance locks of every deployment
    runtime: Path  # this deployment's live state file
    state: Path  # this deployment's run history
    role: Role = Role.ENGINE

    @property
    def state_file(self) -> Path:
        return self.runtime / self.role.state_subdirectory / self.role.state_file_name

    @property
    def history_file(self) -> Path:
        return self.state / self.role.history_file_name


def unit_name(name: str, role: Role = Role.ENGINE) -> str:
    """The unit that runs deployment `name` (without `.service`): the plain unit runs the deployment of
    /etc/kimi-supervisor/kimi-supervisor.toml, the template `kimi-supervisor@.service` every other one, and
    `kimi-supervisor-weights@.service` a deployment's weight holder (NAME.weights.toml).
    Also its journal's SYSLOG_IDENTIFIER and the title `status` gives it."""
    template = role_spec.of(role).unit_template
    if template is not None:
        return f"{template}@{name}"
    return PLAIN if name == PLAIN else f"{PLAIN}@{name}"


def holder_service(name: str) -> str:
    """The systemd unit of deployment `name`'s weight holder."""
    return unit_name(name, Role.WEIGHTS) + ".service"


def directories(paths: PathsConfig, name: str, role: Role = Role.ENGINE) -> DeploymentDirectories:
    # `name` passed config/load.py's check: no separator, no leading dot, so it is one path component.
    runtime, state = paths.runtime_directory, paths.state_directory
    return DeploymentDirectories(name, locks=runtime, runtime=runtime / name, state=state / name, role=role)


def of(cfg: Config) -> DeploymentDirectories:
    return directories(cfg.paths, cfg.deployment.name, cfg.role)


def holder_of(cfg: Config) -> DeploymentDirectories:
    """The files of `cfg`'s deployment's weight holder (the engine reads its state file)."""
    return directories(cfg.paths, cfg.deployment.name, Role.WEIGHTS)
