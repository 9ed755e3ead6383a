"""A start broken down, in words and numbers, from its run record (history.LOAD_FIELDS).

    Last load: weights 523 s at 1.03 GB/s from nfs4 (12% cached), post-processing 9 s, compile 38 s (cache hit),
               graphs 61 s, engine init 132 s

"at X GB/s" is the effective rate: the checkpoint's bytes over vLLM's `Loading weights took` (what the loader
achieved, page-cache hits included); "read Y GB" is what came from storage (the child tree's read_bytes).
"""

from __future__ import annotations

from kimi_supervisor.child.loadphases import PHASE_NAMES
from kimi_supervisor.host.procio import format_rate
from kimi_supervisor.opsview.history import RunRecord


def phases_of(r: RunRecord) -> dict[str, float]:
    """{phase: seconds} by loadphases.PHASE_NAMES, for the phases the run's vLLM reported."""
    values = {name: getattr(r, f"{name}_s") for name in PHASE_NAMES}
    return {k: float(v) for k, v in values.items() if v is not None}


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2g} s"


def describe(r: RunRecord) -> str | None:
    """One line (see the module docstring); None when the run recorded no phase at all."""
    parts: list[str] = []
    if r.weights_s is not None:
        text = f"weights {_seconds(r.weights_s)}"
        if r.checkpoint_bytes and r.weights_s > 0:
            text += f" at {format_rate(r.checkpoint_bytes / r.weights_s)}"
        if r.fs_type:
            text += f" from {r.fs_type.lower()}"
        extra = []
        if r.cached_fraction is not None:
            extra.append(f"{r.cached_fraction * 100:.0f}% cached")
        if r.read_bytes is not None:
            extra.append(f"read {r.read_bytes / 1e9:.2f} GB")
        if extra:
            text += f" ({', '.join(extra)})"
        parts.append(text)
    if r.post_processing_s is not None:
        parts.append(f"post-processing {_seconds(r.post_processing_s)}")
    if r.compile_s is not None or r.compile_cache is not None:
        text = "compile" + (f" {_seconds(r.compile_s)}" if r.compile_s is not None else "")
        if r.compile_cache is not None:
            text += f" (cache {r.compile_cache})"
        parts.append(text)
    if r.graphs_s is not None:
        parts.append(f"graphs {_seconds(r.graphs_s)}")
    if r.init_engine_s is not None:
        parts.append(f"engine init {_seconds(r.init_engine_s)}")
    return ", ".join(parts) if parts else None
