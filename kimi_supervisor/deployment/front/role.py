"""The front as a role (docs/front.md): `NAME.front.toml`, role "front", run by `kimi-supervisor-front@NAME`.

No child and no GPU: its run is the proxy's loop (serve.py), not the lifecycle's Supervisor.  Its locks carry
its own suffix (a second front of the deployment is refused, its engine is not), and the port it locks is its
public one, which its engine on --uds leaves to it.
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.spawnplan import Identity, Unresolvable, account, resolve_identity
from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment, RunContext
from kimi_supervisor.deployment.front.records import hold_bound
from kimi_supervisor.exitcodes import ConfigError, ExitCode, SupervisorError
from kimi_supervisor.roles import Role
from kimi_supervisor.systemd import unit


class Front(Deployment):
    """A peer of the supervised roles (deployment/supervised.py): no child, so no lifecycle to answer; its locks
    carry its role's file suffix (base.py lock_suffix)."""

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
        own = Role.FRONT.config_name(name)
        if config.name != own:
            raise ConfigError(
                f"{config}: kimi-supervisor-front@{name} runs {config.parent}/{own}: "
                "name the front's config after its deployment"
            )
        return unit.install_front(config, unit_dir, reload=reload)

    def run(self, ctx: RunContext) -> ExitCode:
        # Imported here: only the front's host needs aiohttp (the [front] extra).
        from kimi_supervisor.deployment.front import serve

        engine = self._engine_for_start()
        return serve.run(self.front, ctx.log, ctx.notifier, ctx.watchdog_s, self._identity(engine))

    def _engine_path(self) -> Path:
        return self.cfg.path.parent / Role.ENGINE.config_name(self.cfg.deployment.name)

    def _engine_for_start(self) -> Config | None:
        """Its engine's config when there is one: a start with an engine that cannot be reached through the socket
        (no --uds there) or cannot resume (no --enable-scale-out) is refused, exit 78, naming the file and the flag."""
        path = self._engine_path()
        if not path.exists():
            return None
        engine = load_config(path)
        missing = self._missing_flags(engine)
        if missing:
            raise ConfigError(
                f"{path}: child.argv lacks {' and '.join(missing)}, which its front needs (docs/front.md)"
            )
        return engine

    def _identity(self, engine: Config | None) -> Identity | None:
        """The account the front serves as (docs/front.md, "Who it runs as"): front.user, else its engine's
        child.user; it must be the engine child's own: vLLM binds the socket 0700 under the unit's UMask=0077 in a
        0700 directory, both that account's."""
        try:
            if self.front.user is not None:
                mine = resolve_identity(self.front.user, None)
            elif engine is not None:
                mine = resolve_identity(engine.child.user, engine.child.group)
            else:
                return None
            if engine is not None:
                theirs = account(resolve_identity(engine.child.user, engine.child.group))
                if account(mine) != theirs:
                    raise ConfigError(
                        f"{self.cfg.path}: front.user: {account(mine)[0]!r} cannot reach the engine's socket, which is "
                        f"{self._engine_path()}'s child account's alone ({theirs[0]!r}): make them the same"
                    )
        except Unresolvable as exc:
            raise ConfigError(f"{self.cfg.path}: front.user: {exc.message}") from None
        return mine

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        checks.insert(0, self._engine_check())
        front = self.front
        socket = front.engine_socket
        there = "there" if socket.exists() else "not there yet (the engine makes it when it starts)"
        hold, whence = hold_bound(front)
        checks.insert(
            0,
            Check(
                "front",
                Verdict.OK,
                f"would listen on {front.host}:{front.port} and forward to the engine's socket {socket} ({there}); "
                f"hold up to {front.queue_max} request(s) for {hold:g}s ({whence}) while the engine is not serving",
                {"host": front.host, "port": front.port, "engine_socket": str(socket)},
            ),
        )

    def _missing_flags(self, engine: Config) -> list[str]:
        wrong = []
        if engine.child.vllm.uds != str(self.front.engine_socket):
            wrong.append(f"--uds {self.front.engine_socket}")
        if "--enable-scale-out" not in engine.child.argv:
            wrong.append("--enable-scale-out (a broken stream's resume needs /inference/v1/generate)")
        return wrong

    def _engine_check(self) -> Check:
        """Its engine's config, NAME.toml beside this one: vLLM on the socket the front reaches, and the
        token-in route a resume needs (without --enable-scale-out vLLM 0.32 answers it 403)."""
        path = self._engine_path()
        try:
            engine = load_config(path)
        except SupervisorError as exc:
            return Check("front_engine", Verdict.WARN, f"its engine's config: {exc.message}")
        wrong = self._missing_flags(engine)
        if wrong:  # the front starts all the same (the engine's config may change first): a warning
            return Check("front_engine", Verdict.WARN, f"{path}: child.argv lacks {' and '.join(wrong)}")
        return Check("front_engine", Verdict.OK, f"{path}: vLLM serves on {self.front.engine_socket}, scale-out on")
