"""A deployment that supervises a child (the engine, the engine on its holder's weights, the weight holder, a
node of a multi-node group): its run builds the lifecycle's dependencies (lifecycle.deps.Deps) and runs
`lifecycle.supervisor.Supervisor`, and as `RolePart` it answers what that run asks of its role.

The defaults are a plain engine's: one host, `vllm serve`, the API on its port.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kimi_supervisor.child.engine_socket import prepare_engine_socket
from kimi_supervisor.child.process import PreparedSpawn, become_subreaper
from kimi_supervisor.config import layout
from kimi_supervisor.config.gpu_pinning import ras_port
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment, RunContext
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps, RolePart
from kimi_supervisor.lifecycle.signals import SignalRecorder
from kimi_supervisor.logs.types import Logger


class SupervisedDeployment(Deployment, RolePart):
    @property
    def serving_port(self) -> int | None:
        """None: vLLM on its --uds socket, whose front owns the public port (docs/front.md)."""
        vllm = self.cfg.child.vllm
        return None if vllm.uds is not None else vllm.port

    @property
    def ras_port(self) -> int | None:
        """None: the config gives the child none (a deployment without GPUs)."""
        return ras_port(self.cfg.child.env)

    def prepare_child(self, cfg: Config, prepared: PreparedSpawn | None, log: Logger) -> None:
        """An engine on vLLM's --uds socket (behind its front, docs/front.md): its directory, no dead socket."""
        if cfg.child.vllm.uds is not None:
            identity = prepared.identity if prepared is not None else None
            prepare_engine_socket(Path(cfg.child.vllm.uds), layout.of(cfg).runtime, identity, log)

    def run(self, ctx: RunContext) -> ExitCode:
        if not become_subreaper():
            ctx.log.warning("subreaper.unavailable", why="orphaned workers will be reparented to PID 1")
        deps = Deps(
            probe=ctx.probe,
            table=PsutilProcessTable(),
            notifier=ctx.notifier,
            log=ctx.log,
            sink=ctx.sink,
            watchdog_s=ctx.watchdog_s,
            signals=SignalRecorder(),  # the clock: the reactor's (Deps builds it over these signals)
        )
        return self.supervise(deps, ctx.secrets)

    def supervise(self, deps: Deps, secrets: tuple[str, ...]) -> ExitCode:
        """Supervise until a stop request (0) or a failure (its SupervisorError)."""
        # Imported here: a refused second instance (exit 16) should not pay for the whole lifecycle.
        from kimi_supervisor.lifecycle.supervisor import Supervisor

        return Supervisor(self.cfg, dataclasses.replace(deps, role=self), secrets).run()
