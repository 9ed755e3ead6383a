"""Preflight GPU health: is a GPU sick before we load 540 GB onto it?

Six checks over NVML's counters (`GpuProbe.health`), each one report line over
all GPUs with the numbers.  What a problem means is policy
(`[gpu_health]`: "fail" blocks the start, "warn" reports it, "off" skips the
check).  A query the GPU does not support is "n/a", never a failure: page
retirement ended with Ampere, row remapping started there, and GeForce cards
have no ECC at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.model import GpuHealthConfig
from kimi_supervisor.host.gpu import GpuHealth, GpuProbe, GpuUnavailable
from kimi_supervisor.logs.types import Logger

# NVML clocks-event reasons that mean the hardware is protecting itself (nvml.h).
CLOCK_REASONS = {
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
GPU_IDLE = 0x1

# (verdict, text) for one GPU: "ok", "bad" (policy decides), "na" (not supported), "error" (query failed).
GpuVerdict = tuple[str, str]


def _errors(h: GpuHealth, *fields: str) -> GpuVerdict | None:
    found = [f"{f}: {h.errors[f]}" for f in fields if f in h.errors]
    return ("error", "could not read " + ", ".join(found)) if found else None


def _retired_pages(h: GpuHealth) -> GpuVerdict:
    if h.retired_pages_pending is None and h.retired_pages is None:
        return _errors(h, "retired_pages_pending", "retired_pages") or ("na", "page retirement not supported")
    count = "an unknown number of" if h.retired_pages is None else str(h.retired_pages)
    pending = "a retirement is pending (needs a GPU reset)" if h.retired_pages_pending else "none pending"
    return ("bad" if h.retired_pages_pending else "ok"), f"{count} retired page(s), {pending}"


def _remapped_rows(h: GpuHealth) -> GpuVerdict:
    if h.remapped_rows_pending is None:
        return _errors(h, "remapped_rows") or ("na", "row remapping not supported")
    counts = f"{h.remapped_rows_correctable} correctable, {h.remapped_rows_uncorrectable} uncorrectable remapped row(s)"
    if h.remapped_rows_failed:
        return "bad", f"row remapping FAILED, no spare rows left ({counts}): the GPU needs replacing"
    if h.remapped_rows_pending:
        return "bad", f"a row remap is pending ({counts}): needs a GPU reset"
    return "ok", f"{counts}, none pending"


def _ecc(h: GpuHealth) -> GpuVerdict:
    if h.ecc_uncorrected_volatile is None:
        return _errors(h, "ecc_uncorrected_volatile") or ("na", "ECC not supported or off")
    n = h.ecc_uncorrected_volatile
    text = f"{n} volatile uncorrectable ECC error(s) since the driver loaded"
    return ("bad" if n > 0 else "ok"), text


def _pcie(h: GpuHealth) -> GpuVerdict:
    if None in (h.pcie_width, h.pcie_max_width, h.pcie_gen, h.pcie_max_gen):
        return _errors(h, "pcie_width", "pcie_max_width", "pcie_gen", "pcie_max_gen") or (
            "na",
            "PCIe link not reported",
        )
    assert h.pcie_width is not None and h.pcie_max_width is not None
    assert h.pcie_gen is not None and h.pcie_max_gen is not None
    text = f"PCIe x{h.pcie_width} gen {h.pcie_gen} (max x{h.pcie_max_width} gen {h.pcie_max_gen})"
    if h.pcie_width < h.pcie_max_width:
        return "bad", f"{text}: link width degraded"
    if h.pcie_gen < h.pcie_max_gen:
        idle = h.clock_event_reasons is not None and h.clock_event_reasons & GPU_IDLE
        if idle:
            # An idle GPU trains its link down to save power; the width is what tells a bad link.
            return "ok", f"{text}: lower generation while idle"
        return "bad", f"{text}: link generation below max while not idle"
    return "ok", text


def _persistence(h: GpuHealth) -> GpuVerdict:
    if h.persistence_mode is None:
        return _errors(h, "persistence_mode") or ("na", "persistence mode not reported")
    if not h.persistence_mode:
        return "bad", "persistence mode off: the driver sets the GPU up again for each client (nvidia-persistenced)"
    return "ok", "persistence mode on"


def _clocks(h: GpuHealth) -> GpuVerdict:
    if h.clock_event_reasons is None:
        return _errors(h, "clock_event_reasons") or ("na", "clock event reasons not reported")
    active = [name for bit, name in CLOCK_REASONS.items() if h.clock_event_reasons & bit]
    if active:
        return "bad", f"clocks held down by {', '.join(active)} (reasons 0x{h.clock_event_reasons:x})"
    return "ok", f"no HW slowdown or thermal clock events (reasons 0x{h.clock_event_reasons:x})"


# (report name, config policy field, per-GPU verdict)
CHECKS: tuple[tuple[str, str, Callable[[GpuHealth], GpuVerdict]], ...] = (
    ("gpu_retired_pages", "retired_pages", _retired_pages),
    ("gpu_remapped_rows", "remapped_rows", _remapped_rows),
    ("gpu_ecc", "ecc_uncorrected", _ecc),
    ("gpu_pcie", "pcie_link", _pcie),
    ("gpu_persistence", "persistence_mode", _persistence),
    ("gpu_clocks", "clock_events", _clocks),
)


def _grouped(rows: list[tuple[int, str]]) -> str:
    """'GPU 0, 1: text; GPU 2: other' - identical findings share one entry."""
    by_text: dict[str, list[int]] = {}
    for gpu, text in rows:
        by_text.setdefault(text, []).append(gpu)
    return "; ".join(f"GPU {', '.join(map(str, gpus))}: {text}" for text, gpus in by_text.items())


def evaluate(health: list[GpuHealth], cfg: GpuHealthConfig) -> list[Check]:
    out = []
    for name, policy_field, verdict_of in CHECKS:
        policy = getattr(cfg, policy_field)
        if policy == "off":
            continue
        verdicts = [(h.index, *verdict_of(h)) for h in health]
        bad = [(gpu, text) for gpu, v, text in verdicts if v == "bad"]
        errors = [(gpu, text) for gpu, v, text in verdicts if v == "error"]
        data: dict[str, Any] = {"policy": policy, "gpus": [{"gpu": g, "verdict": v, "text": t} for g, v, t in verdicts]}
        if bad:
            verdict = Verdict.FAIL if policy == "fail" else Verdict.WARN
            message = _grouped(bad + errors)
        elif errors:
            verdict, message = Verdict.WARN, _grouped(errors)
        elif all(v == "na" for _, v, _ in verdicts):
            verdict, message = Verdict.NA, _grouped([(g, t) for g, _, t in verdicts])
        else:
            verdict, message = Verdict.OK, _grouped([(g, t) for g, _, t in verdicts])
        out.append(Check(name, verdict, message, data))
    return out


def health_checks(
    probe: GpuProbe, gpus: tuple[int, ...], cfg: GpuHealthConfig, log: Logger | None = None
) -> list[Check]:
    """The report lines for `gpus`; warnings are logged too, since a real start shows no report."""
    try:
        health = [probe.health(i) for i in gpus]
    except GpuUnavailable as exc:
        checks = [Check("gpu_health", Verdict.WARN, f"could not read GPU health: {exc}")]
    else:
        checks = evaluate(health, cfg)
    if log is not None:
        for c in checks:
            if c.verdict is Verdict.WARN:
                log.warning("preflight.gpu_health", check=c.name, message=c.message)
    return checks
