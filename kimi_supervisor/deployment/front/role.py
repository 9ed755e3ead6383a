"""The front as a role (docs/front.md): `NAME.front.toml`, role "front", run by `kimi-supervisor-front@NAME`.

No child and no GPU: its run is the proxy's loop (serve.py), not the lifecycle's Supervisor.  Its locks carry
its own suffix (a second front of the deployment is refused, its engine is not), and the port it locks is its
public one, which its engine on --uds leaves to it.
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.systemd import unit

FRONT_SUFFIX = ".front"


class FrontRole(Deployment):
    lock_suffix = FRONT_SUFFIX
    drains = False  # it has no child to drain

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        assert cfg.front is not None  # config/load.py: a front's config has its [front]
        self.front = cfg.front

    @property
    def serving_port(self) -> int | None:
        return self.front.port

    @property
    def ras_port(self) -> int | None:
        return None  # no NCCL here

    def install_own_unit(self, config: Path, unit_dir: Path, reload: bool) -> Path | None:
        """kimi-supervisor-front@NAME runs NAME.front.toml beside the engine's NAME.toml."""
        name = self.cfg.deployment.name
        if config.name != f"{name}.front.toml":
            raise ConfigError(
                f"{config}: kimi-supervisor-front@{name} runs {config.parent}/{name}.front.toml: "
                "name the front's config after its deployment"
            )
        return unit.install_front(config, unit_dir, reload=reload)

    def run(self, deps: Deps, secrets: tuple[str, ...]) -> ExitCode:
        # Imported here: only the front's host needs aiohttp (the [front] extra).
        from kimi_supervisor.deployment.front import serve

        return serve.run(self.front, deps.log, deps.notifier, deps.watchdog_s)

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        front = self.front
        socket = front.engine_socket
        there = "there" if socket.exists() else "not there yet (the engine makes it when it starts)"
        checks.insert(
            0,
            Check(
                "front",
                Verdict.OK,
                f"would listen on {front.host}:{front.port} and forward to the engine's socket {socket} ({there}); "
                f"hold up to {front.queue_max} request(s) for {front.hold_s:g}s while the engine is not serving",
                {"host": front.host, "port": front.port, "engine_socket": str(socket)},
            ),
        )
