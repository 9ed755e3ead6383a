"""The engine: `vllm serve` on one host.  With `[weights] holder = true` it maps its weight holder's weights
(docs/weight-holder.md): it waits for the holder before the preflight, counts the holder's memory as its own,
and install-unit writes the holder's unit beside its own."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config import timeouts
from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.front.role import Front
from kimi_supervisor.deployment.supervised import SupervisedDeployment
from kimi_supervisor.deployment.weights import cuda_ipc_check
from kimi_supervisor.exitcodes import ConfigError, SupervisorError
from kimi_supervisor.host.gpu import GpuProbe, GpuUnavailable, gpu_processes
from kimi_supervisor.host.proctable import ProcessTable
from kimi_supervisor.lifecycle.deps import Run
from kimi_supervisor.lifecycle.holderwait import look, wait_for_holder
from kimi_supervisor.lifecycle.signals import StopRequested
from kimi_supervisor.roles import Role
from kimi_supervisor.systemd import unit


class Engine(SupervisedDeployment):
    """One host's engine, its own weights loaded by vLLM."""

    def front_config(self, config: Path) -> Path | None:
        """NAME.front.toml beside the engine's config: its front, refused (exit 78) where the front's start would
        refuse it (another deployment's, or this engine's argv without what the front needs)."""
        name = self.cfg.deployment.name
        path = config.parent / Role.FRONT.config_name(name)
        if not path.exists():
            return None
        front = load_config(path)
        if front.role is not Role.FRONT or front.deployment.name != name:
            raise ConfigError(
                f'{path}: deployment: expected role = "front" and name = {name!r} (the front of {config}), '
                f"got role {front.role.value!r}, name {front.deployment.name!r}"
            )
        missing = Front(front).missing_flags(self.cfg)
        if missing:
            raise ConfigError(f"{config}: child.argv lacks {' and '.join(missing)}, which its front {path} needs")
        return path


class HeldWeightsEngine(Engine):
    """An engine that maps the weights its deployment's weight holder keeps (`--load-format ipc_cache`)."""

    def before_preflight(self, run: Run) -> None:
        from kimi_supervisor.lifecycle.supervisor import EXTEND_MARGIN_S, usec  # a run's (see supervised.py)

        weights = run.cfg.weights
        assert weights is not None
        run.state.enter_initial("waiting for the deployment's weight holder")
        run.notify(EXTEND_TIMEOUT_USEC=usec(weights.wait_s + EXTEND_MARGIN_S))
        if wait_for_holder(run.cfg, run.clock, run.log, run.stop_signalled, run.state.say) is None:
            raise StopRequested

    def own_memory(self, cfg: Config, table: ProcessTable, probe: GpuProbe, gpus: tuple[int, ...]) -> dict[int, int]:
        # The weight holder outlives its engine by design, and the spare serves while the engine is down (and the
        # engine while the spare restarts): what they hold is not this stop's to wait for.
        from kimi_supervisor.preflight.run import own_memory  # a run's (see supervised.py)

        try:
            return own_memory(cfg, table, gpu_processes(probe, gpus))
        except GpuUnavailable:
            return {}  # confirm_gpus_free says NVML cannot tell

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        """Whether the holder is ready and of the same cache key; without a GPU, that vLLM's daemon cannot run."""
        cfg = self.cfg
        assert cfg.weights is not None
        out: list[Check] = []
        try:
            seen = look(cfg)
        except SupervisorError as exc:
            out.append(Check("weights", Verdict.FAIL, exc.message))
        else:
            if seen.ready:
                out.append(Check("weights", Verdict.OK, f"weight holder {seen.why}: a start maps its weights"))
            else:
                out.append(
                    Check(
                        "weights",
                        Verdict.WAIT,
                        f"a start would wait up to {cfg.weights.wait_s:g}s (weights.wait_s) for the weight holder, "
                        f"then exit 21: {seen.why}",
                    )
                )
        if gpu_count == 0:
            out.append(cuda_ipc_check())
        checks[:0] = out

    def holder_unit(self, config: Path, instance: str | None) -> unit.HolderUnit | None:
        """The holder's unit too, from the holder's own config."""
        cfg = self.cfg
        if instance is None:
            raise ConfigError(
                f"{config}: weights.holder: true needs the unit pair: install-unit --instance {cfg.deployment.name}"
            )
        holder_config = config.parent / Role.WEIGHTS.config_name(instance)
        holder = load_config(holder_config)
        if holder.role is not Role.WEIGHTS or holder.deployment.name != instance:
            raise ConfigError(
                f'{holder_config}: deployment: expected role = "weights" and name = {instance!r} (the holder of '
                f"kimi-supervisor@{instance}), got role {holder.role.value!r}, name {holder.deployment.name!r}"
            )
        return unit.HolderUnit(timeouts.unit_timeout_stop_s(holder), unit.writable_paths(holder), unit.serving(holder))
