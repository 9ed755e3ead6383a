"""The hot spare (docs/spare.md): a second `vllm serve` of the deployment on the engine's GPUs, mapping the weight
holder's weights, on its own socket with its own small KV cache; the front sends requests to it while the engine
does not serve.

Everything an engine on held weights does, it does (deployment/engine.py HeldWeightsEngine: it waits for the holder,
its preflight, readiness, liveness, drain and forensics are an engine's); what is its own is its config (its argv is
its engine's, config/spare.py), its locks and files (the role's `.spare` suffix), its unit
(`kimi-supervisor-spare@NAME`, systemd/unit.py) and its memory (preflight/memory_plan.py, and the engine's tree as
its own: config/role_spec.py memory_partners).
"""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.deployment.engine import HeldWeightsEngine
from kimi_supervisor.systemd import unit


class Spare(HeldWeightsEngine):
    def install_own_unit(self, config: Path, unit_dir: Path, reload: bool, instance: str | None) -> Path | None:
        """kimi-supervisor-spare@NAME runs NAME.spare.toml beside the engine's NAME.toml."""
        self.own_unit_config(config, instance, "kimi-supervisor-spare", "spare")
        return unit.install_spare(config, self.cfg, unit_dir, reload=reload)

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        """The engine's view of its holder, and what the spare is: its engine's argv, its own flags."""
        super().dry_run(checks, gpu_count)
        spare = self.cfg.spare
        assert spare is not None
        checks.insert(
            0,
            Check(
                "spare",
                Verdict.OK,
                f"a hot spare of {spare.engine_config}: its argv, on {self.cfg.child.vllm.uds}, with its own "
                f"--kv-cache-memory-bytes {spare.kv_cache_memory_bytes} and --gpu-memory-utilization "
                f"{spare.gpu_memory_utilization:g}; its tokens' key {spare.output_key[:12]} is the engine's",
                {"argv": list(self.cfg.child.argv), "output_key": spare.output_key},
            ),
        )
