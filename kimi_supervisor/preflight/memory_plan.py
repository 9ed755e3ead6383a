"""The hot spare's memory plan (docs/spare.md): do the held weights, the engine and the spare fit on each GPU?

Three supervisors of one deployment share every GPU: the weight holder (one copy of the weights, which both engines
map), the engine (its --gpu-memory-utilization budget, which with held weights covers its KV cache, activations,
graphs and context: vLLM sizes its KV cache as utilization x total minus what it found used, the held weights
credited, v1/worker/utils.py:716-768) and the spare (its own --kv-cache-memory-bytes plus its context, communicators
and graphs: `[spare] overhead_mib`, measured by the runbook in docs/spare.md).  Each number is named, per GPU, with
where it came from; a GPU where their sum and `[spare] margin_mib` exceed the total refuses the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.model import SpareConfig
from kimi_supervisor.host.gpu import MIB, GpuMemory


def checkpoint_mib_per_gpu(model: str | None, world_size: int) -> int | None:
    """The weights' share of one GPU from the checkpoint's safetensors on disk (an estimate: NVFP4 scales and
    post-processing change it a little); None without a local checkpoint."""
    if model is None or world_size < 1:
        return None
    try:
        sizes = [p.stat().st_size for p in Path(model).glob("*.safetensors")]
    except OSError:
        return None
    return sum(sizes) // MIB // world_size if sizes else None


def plan(
    memory: Sequence[GpuMemory],
    weights_mib: Mapping[int, int],
    weights_whence: str,
    spare: SpareConfig,
) -> Check:
    """The `memory_plan` check: per GPU, weights + engine + spare + margin against the total."""
    spare_mib = spare.kv_cache_memory_bytes // MIB + spare.overhead_mib
    rows: list[dict[str, int]] = []
    texts: list[str] = []
    for m in memory:
        weights = weights_mib.get(m.index, 0)
        if spare.engine_kv_cache_memory_bytes is not None:
            engine_mib = spare.engine_kv_cache_memory_bytes // MIB + spare.overhead_mib
            engine_whence = f"its --kv-cache-memory-bytes + {spare.overhead_mib} MiB overhead"
        else:
            util = spare.engine_gpu_memory_utilization
            engine_mib = max(0, int(util * m.total_mib) - weights)
            engine_whence = f"its --gpu-memory-utilization {util:g} x total - weights"
        need = weights + engine_mib + spare_mib + spare.margin_mib
        rows.append(
            {
                "gpu": m.index,
                "total_mib": m.total_mib,
                "weights_mib": weights,
                "engine_mib": engine_mib,
                "spare_mib": spare_mib,
                "margin_mib": spare.margin_mib,
                "left_mib": m.total_mib - need,
            }
        )
        texts.append(
            f"GPU {m.index}: weights {weights} MiB ({weights_whence}) + engine {engine_mib} MiB ({engine_whence}) + "
            f"spare {spare_mib} MiB (KV {spare.kv_cache_memory_bytes // MIB} + overhead {spare.overhead_mib}) + "
            f"margin {spare.margin_mib} MiB = {need} of {m.total_mib} MiB"
        )
    data = {"gpus": rows}
    short = [text for text, row in zip(texts, rows, strict=True) if row["left_mib"] < 0]
    if short:
        return Check(
            "memory_plan",
            Verdict.FAIL,
            "the weights, the engine and the spare do not fit: "
            + "; ".join(short)
            + ": lower spare.kv_cache_memory_bytes or the engine's --gpu-memory-utilization",
            data,
        )
    if not rows:
        return Check("memory_plan", Verdict.SKIP, "no GPU to plan", data)
    tightest = min(range(len(rows)), key=lambda i: rows[i]["left_mib"])
    return Check(
        "memory_plan",
        Verdict.OK,
        f"the weights, the engine and the spare fit on each of {len(rows)} GPU(s); the tightest, {texts[tightest]}, "
        f"leaves {rows[tightest]['left_mib']} MiB",
        data,
    )
