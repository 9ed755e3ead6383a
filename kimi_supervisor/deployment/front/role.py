"""The front as a role (docs/front.md): `NAME.front.toml`, role "front", run by `kimi-supervisor-front@NAME`.

No child and no GPU: its run is the proxy's loop (serve.py), not the lifecycle's Supervisor.  Its locks carry
its own suffix (a second front of the deployment is refused, its engine is not), and the port it locks is its
public one, which its engine on --uds leaves to it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.spawnplan import Identity, Unresolvable, account, resolve_identity
from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment, RunContext
from kimi_supervisor.deployment.front.records import hold_bound
from kimi_supervisor.exitcodes import ConfigError, ExitCode, SupervisorError
from kimi_supervisor.preflight.checks import check_port
from kimi_supervisor.roles import Role
from kimi_supervisor.systemd import unit

# pyproject's dependency: the front uses web.RequestKey, new in 3.14 (an older one failed on its first request).
HTTP_STACK = "aiohttp>=3.14,<4"
HTTP_STACK_SINCE = (3, 14)


def http_stack_missing() -> str | None:
    """Why the front's HTTP stack is not usable here, with the line that installs it into this very Python (the
    README's venv: its own pip); None: it is.  A dependency, so only a `--no-deps` install or an older aiohttp on the
    path gets here."""
    try:
        import aiohttp
    except ImportError as exc:
        found = f"it cannot be imported ({exc})"
    else:
        version = tuple(int(n) for n in re.findall(r"\d+", aiohttp.__version__)[:2])
        if HTTP_STACK_SINCE <= version < (4,):
            return None
        found = f"aiohttp {aiohttp.__version__} is installed"
    return f"the front needs {HTTP_STACK}: {found}; install it: {sys.executable} -m pip install '{HTTP_STACK}'"


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

    def install_own_unit(self, config: Path, unit_dir: Path, reload: bool, instance: str | None) -> Path | None:
        """kimi-supervisor-front@NAME runs NAME.front.toml beside the engine's NAME.toml."""
        self.own_unit_config(config, instance, "kimi-supervisor-front", "front")
        return unit.install_front(config, unit_dir, reload=reload)

    def run(self, ctx: RunContext) -> ExitCode:
        missing = http_stack_missing()
        if missing is not None:  # a config error (78, no restart loop), not a crash on the import below (70)
            raise ConfigError(missing)
        # Imported here: a dry run, install-unit and `status` of a front never load the HTTP stack.
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
        missing = self.missing_flags(engine)
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
        """The verdict of a start (its checks, in its order): the HTTP stack, the public port, its engine's config
        and the account it serves as; each FAILED where the start exits (78 or 10), WARN only where it proceeds."""
        front = self.front
        socket = front.engine_socket
        there = "there" if socket.exists() else "not there yet (the engine makes it when it starts)"
        hold, whence = hold_bound(front)
        missing = http_stack_missing()
        checks[:0] = [
            Check(
                "front",
                Verdict.OK,
                f"would listen on {front.host}:{front.port} and forward to the engine's socket {socket} ({there}); "
                f"hold up to {front.queue_max} request(s) for {hold:g}s ({whence}) while the engine is not serving",
                {"host": front.host, "port": front.port, "engine_socket": str(socket)},
            ),
            Check("front_http", Verdict.OK, f"{HTTP_STACK} importable")
            if missing is None
            else Check("front_http", Verdict.FAIL, missing),
            self._port_check(),
            self._engine_check(),
        ]

    def _port_check(self) -> Check:
        """The public port as the start binds it (serve.py listen): taken, it names the listener (exit 10)."""
        front = self.front
        if front.port < 1024 and os.geteuid() != 0:
            return Check("port", Verdict.SKIP, f"port {front.port} < 1024 binds as root only: run the dry run as root")
        return check_port(front.host, front.port)

    def missing_flags(self, engine: Config) -> list[str]:
        wrong = []
        if engine.child.vllm.uds != str(self.front.engine_socket):
            wrong.append(f"--uds {self.front.engine_socket}")
        if "--enable-scale-out" not in engine.child.argv:
            wrong.append("--enable-scale-out (a broken stream's resume needs /inference/v1/generate)")
        return wrong

    def _engine_check(self) -> Check:
        """Its engine's config, NAME.toml beside this one, as the start reads it (_engine_for_start, _identity): vLLM
        on the socket the front reaches, the token-in route a resume needs (without --enable-scale-out vLLM 0.32
        answers it 403), and one account for the engine's child and the front."""
        path = self._engine_path()
        if not path.exists():  # the start proceeds and holds requests until an engine serves on the socket
            return Check("front_engine", Verdict.WARN, f"{path}: no engine config beside the front's")
        try:
            engine = self._engine_for_start()
            mine = self._identity(engine)
        except SupervisorError as exc:
            return Check("front_engine", Verdict.FAIL, exc.message)
        who = "the account it starts as (no child.user)" if mine is None else f"user {mine.user!r}"
        sock = self.front.engine_socket
        return Check(
            "front_engine", Verdict.OK, f"{path}: vLLM serves on {sock}, scale-out on; the front serves as {who}"
        )
