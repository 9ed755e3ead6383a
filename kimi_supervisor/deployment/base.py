"""What every deployment answers, a front's as much as a supervised child's: its instance locks, its units, its
dry run and its run (cli/entry.py asks it).  What a supervised child adds, the lifecycle's part
(lifecycle.deps.RolePart), is supervised.py's; a front (front/role.py) is a peer of it, not a kind of engine.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.checks import Check
from kimi_supervisor.config import role_spec
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.host import instance_lock
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.logs.journal import ChildSink
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd import unit
from kimi_supervisor.systemd.notify import Notifier


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every run has, built by cli before it: the log, systemd's notifier (secrets redacted) and watchdog
    interval, the secret values to scrub, and what cli opened for the instance lock (the GPU probe, which it
    closes after the run, and the journal sink of the child's output)."""

    log: Logger
    notifier: Notifier
    watchdog_s: float | None
    secrets: tuple[str, ...]
    probe: GpuProbe
    sink: ChildSink


class Deployment(abc.ABC):
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @property
    def lock_suffix(self) -> str:
        """Added to the names of its instance locks (host/instance_lock.py): its role's file suffix (roles.py), ""
        for the deployment's own."""
        return self.cfg.role.file_suffix

    @property
    def status_port(self) -> int | None:
        """A port of its own, locked with the rest (16 for a second supervisor that wants it)."""
        return None

    @property
    def has_child(self) -> bool:
        """It spawns a child (config/role_spec.py): a dry run checks what the spawn would need."""
        return role_spec.of(self.cfg.role).has_child

    @property
    @abc.abstractmethod
    def serving_port(self) -> int | None:
        """The TCP port it serves on, locked host-wide; None: none of its own."""

    @property
    @abc.abstractmethod
    def ras_port(self) -> int | None:
        """A child's NCCL RAS port (config/gpu_pinning.py), host-wide like its serving port; None: no NCCL here."""

    def lock_resources(self, gpus: Sequence[int]) -> instance_lock.Resources:
        """What its start locks (and its dry run looks at) on the host: `gpus`, those of its config NVML found."""
        cfg = self.cfg
        return instance_lock.Resources(
            cfg.paths.runtime_directory,
            tuple(gpus),
            self.serving_port,
            cfg.deployment.name,
            cfg.metrics.textfile,
            self.lock_suffix,
            self.status_port,
            self.ras_port,
        )

    @abc.abstractmethod
    def run(self, ctx: RunContext) -> ExitCode:
        """Run until a stop request (0) or a failure (its SupervisorError); its locks are held."""

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:  # noqa: B027 - a hook a plain engine leaves empty
        """Add what the dry run shows of this role to its report's checks."""

    def install_own_unit(self, config: Path, unit_dir: Path, reload: bool, instance: str | None) -> Path | None:
        """A role with a unit of its own, not the engine's pair, writes it here (install-unit) and returns its
        path; None: install-unit writes the engine's units.  `instance`: install-unit's --instance, honoured or
        refused."""
        return None

    def own_unit_config(self, config: Path, instance: str | None, unit_name: str, what: str) -> None:
        """install-unit of a role whose template `unit_name`@NAME runs NAME<suffix>.toml: `config` must be that
        file and --instance, if given, NAME; else ConfigError (78) saying which to give."""
        name = self.cfg.deployment.name
        own = self.cfg.role.config_name(name)
        if instance is not None and instance != name:
            raise ConfigError(
                f"install-unit --instance {instance}: {config} is the {what} of deployment {name!r} "
                f"({unit_name}@{name}): give --instance {name}, or the config of {instance!r}"
            )
        if config.name != own:
            raise ConfigError(
                f"{config}: {unit_name}@{name} runs {config.parent}/{own}: name the {what}'s config after its "
                "deployment"
            )

    def front_config(self, config: Path) -> Path | None:
        """The deployment's front config beside `config` (NAME.front.toml) whose unit install-unit writes with this
        one's; None: no front (none written, so none asked for)."""
        return None

    def holder_unit(self, config: Path, instance: str | None) -> unit.HolderUnit | None:
        """The weight holder's unit that install-unit writes beside this deployment's; None: no holder."""
        return None
