"""The weight holder: `vllm preload`, one process per GPU keeping the weights that its deployment's engine maps
(docs/weight-holder.md).  Its own locks (it takes its engine's GPUs), its socket directory made for its child,
no drain (it serves no requests), and install-unit takes the engine's config, not its own."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.process import PreparedSpawn
from kimi_supervisor.child.socketdir import prepare_socket_dir
from kimi_supervisor.child.spawnplan import Unresolvable, account, resolve_identity
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.supervised import SupervisedDeployment
from kimi_supervisor.exitcodes import ConfigError, SupervisorError
from kimi_supervisor.host import checkpoint
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd import unit


class WeightHolder(SupervisedDeployment):
    # Its engine's GPUs under its own lock names: its role's file suffix (base.py lock_suffix).
    drains = False  # it serves no requests (and has no /metrics)

    def prepare_child(self, cfg: Config, prepared: PreparedSpawn | None, log: Logger) -> None:
        # Before the spawn: vLLM's daemon could not make it in root's directory, after its whole load.
        assert cfg.weights is not None
        identity = prepared.identity if prepared is not None else None
        made = prepare_socket_dir(cfg.weights.socket_dir, identity)
        user, uid = account(identity)
        log.info("weights.socket_dir", path=str(made.path), user=user, uid=uid, made=made.made)

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        """The holder's own settings; without a GPU, that vLLM's real daemon cannot run here."""
        cfg = self.cfg
        assert cfg.weights is not None
        key = ", ".join(f"{k}={v}" for k, v in cfg.weights.key.items() if v is not None)
        try:
            found = checkpoint.fingerprint(cfg.weights.key.get("model"))
            held = (
                "not a local checkpoint (vLLM keys on the model's name)"
                if found is None
                else f"{len(found.shards)} shard header(s), vLLM fingerprint {found.digest[:12]}"
            )
        except checkpoint.CheckpointError as exc:
            found, held = None, f"unreadable ({exc})"
        out = [
            Check(
                "weights",
                Verdict.OK,
                f"weight holder: sockets in {cfg.weights.socket_dir}, ready on vLLM's READY line and "
                f"{cfg.readiness.health_url} 200; cache key {key}; checkpoint: {held}",
                {
                    "socket_dir": str(cfg.weights.socket_dir),
                    "key": dict(cfg.weights.key),
                    "checkpoint": None if found is None else found.digest,
                },
            ),
            self._socket_dir_check(),
        ]
        if gpu_count == 0:
            out.append(cuda_ipc_check())
        checks[:0] = out

    def _socket_dir_check(self) -> Check:
        """What a start would make for the holder's child (child/socketdir.py), made and chowned here never."""
        cfg = self.cfg
        assert cfg.weights is not None
        try:
            identity = resolve_identity(cfg.child.user, cfg.child.group)
            found = prepare_socket_dir(cfg.weights.socket_dir, identity, create=False)
        except Unresolvable as exc:
            return Check("weights_socket_dir", Verdict.SKIP, f"child.{exc.key}: {exc.message}")
        except SupervisorError as exc:
            return Check("weights_socket_dir", Verdict.FAIL, exc.message)
        user, uid = account(identity)
        done = "exists, owned by" if found.exists else "a start would create it, 0700, owned by"
        data = {"path": str(found.path), "exists": found.exists, "user": user, "uid": uid}
        return Check("weights_socket_dir", Verdict.OK, f"{found.path}: {done} user {user!r} (uid {uid})", data)

    def holder_unit(self, config: Path, instance: str | None) -> unit.HolderUnit | None:
        raise ConfigError(
            f"{config}: deployment.role: 'weights': install-unit takes the engine's config "
            f"({config.parent}/{self.cfg.deployment.name}.toml, [weights] holder = true) and writes both units"
        )


def cuda_ipc_check() -> Check:
    """Without a GPU: the holder's daemon cannot run here, and its engine has nothing to map."""
    return Check(
        "weights_cuda_ipc",
        Verdict.WARN,
        "no GPU here: the real `vllm preload` refuses without CUDA IPC (check_ipc_platform_support), "
        "and `--load-format ipc_cache` has nothing to map",
    )
