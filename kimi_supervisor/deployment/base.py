"""What every role answers: the lifecycle's part (lifecycle.deps.RolePart) and cli's (locks, dry run, units).

The defaults are a plain engine's: one host, `vllm serve`, the API on its port.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kimi_supervisor.checks import Check
from kimi_supervisor.child.engine_socket import prepare_engine_socket
from kimi_supervisor.child.process import PreparedSpawn
from kimi_supervisor.config import layout, role_spec
from kimi_supervisor.config.gpu_pinning import ras_port
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.lifecycle.deps import Deps, RolePart
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd import unit


class Deployment(RolePart):
    # Added to the names of its instance locks (host/instance_lock.py): "" takes the deployment's own.
    lock_suffix = ""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @property
    def status_port(self) -> int | None:
        """A port of its own, locked with the rest (16 for a second supervisor that wants it)."""
        return None

    @property
    def has_child(self) -> bool:
        """It spawns a child (config/role_spec.py): a dry run checks what the spawn would need."""
        return role_spec.of(self.cfg.role).has_child

    @property
    def serving_port(self) -> int | None:
        """The TCP port it serves on, locked host-wide; None: vLLM on its --uds socket, whose front owns the public
        port (docs/front.md)."""
        vllm = self.cfg.child.vllm
        return None if vllm.uds is not None else vllm.port

    @property
    def ras_port(self) -> int | None:
        """Its child's NCCL RAS port (config/gpu_pinning.py): host-wide like its serving port, locked with the
        rest.  None: the config gives the child none (a deployment without GPUs)."""
        return ras_port(self.cfg.child.env)

    def prepare_child(self, cfg: Config, prepared: PreparedSpawn | None, log: Logger) -> None:
        """An engine on vLLM's --uds socket (behind its front, docs/front.md): its directory, no dead socket."""
        if cfg.child.vllm.uds is not None:
            identity = prepared.identity if prepared is not None else None
            prepare_engine_socket(Path(cfg.child.vllm.uds), layout.of(cfg).runtime, identity, log)

    def run(self, deps: Deps, secrets: tuple[str, ...]) -> ExitCode:
        """Supervise until a stop request (0) or a failure (its SupervisorError)."""
        # Imported here: a refused second instance (exit 16) should not pay for the whole lifecycle.
        from kimi_supervisor.lifecycle.supervisor import Supervisor

        return Supervisor(self.cfg, dataclasses.replace(deps, role=self), secrets).run()

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        """Add what the dry run shows of this role to its report's checks."""

    def install_own_unit(self, config: Path, unit_dir: Path, reload: bool) -> Path | None:
        """A role with a unit of its own, not the engine's pair, writes it here (install-unit) and returns its
        path; None: install-unit writes the engine's units."""
        return None

    def holder_unit(self, config: Path, instance: str | None) -> unit.HolderUnit | None:
        """The weight holder's unit that install-unit writes beside this deployment's; None: no holder."""
        return None
