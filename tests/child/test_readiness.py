"""Readiness tracker: phases move forward, progress parses, started and fatal lines are found."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config

CFG = parse_config({"child": {"argv": ["vllm", "serve", "/m"]}}, Path("t.toml")).readiness


def feed_all(lines: list[str]) -> ReadinessTracker:
    t = ReadinessTracker(CFG)
    for line in lines:
        t.feed(line)
    return t


def test_progress_and_headline() -> None:
    t = ReadinessTracker(CFG)
    ev = t.feed("(Worker_TP0 pid=5) Loading safetensors checkpoint shards:  57% Completed | 68/119 [04:12<03:10]")
    assert ev.phase_changed and ev.progress_changed
    assert t.headline(252) == "loading weights 68/119 (57%), 4m12s"
    assert not t.feed("Loading safetensors checkpoint shards:  57% Completed | 68/119 [04:13<03:09]").progress_changed


def test_phases_only_move_forward() -> None:
    t = feed_all(
        [
            "(APIServer pid=1) INFO 11-29 16:40:01 [api_server.py:1] vLLM API server version 0.11.0",
            "(EngineCore_DP0 pid=2) INFO 11-29 16:40:02 [core.py:1] Initializing a V1 LLM engine (v0.11.0) with config",
            "(Worker_TP0 pid=3) INFO 11-29 16:40:03 [gpu_model_runner.py:1] Starting to load model /m...",
            "(Worker_TP0 pid=3) INFO 11-29 16:49:06 [gpu_model_runner.py:2] "
            "Model loading took 70.8 GiB and 523.1 seconds",
            "(EngineCore_DP0 pid=2) INFO 11-29 16:49:10 [kv_cache_utils.py:1] GPU KV cache size: 178,000 tokens",
            "(Worker_TP0 pid=3) Loading safetensors checkpoint shards: 100% Completed | 119/119",  # a late echo
        ]
    )
    assert t.phase == "profiling KV cache"
    assert not t.server_started


def test_started_patterns_of_each_version() -> None:
    for line in [
        "(APIServer pid=1) INFO 11-29 16:40:01 [api_server.py:1] Starting vLLM API server 0 on http://0.0.0.0:8000",
        "(APIServer pid=1) INFO 11-29 16:40:01 [api_server.py:1] Starting vLLM server on http://0.0.0.0:8000",
        "(APIServer pid=1) INFO 11-29 16:40:01 [api_server.py:1] Starting vLLM API server on http://0.0.0.0:8000",
        "INFO:     Application startup complete.",
    ]:
        t = ReadinessTracker(CFG)
        assert t.feed(line).started, line
        assert t.phase == "API server up, waiting for /health"


def test_fatal_record_and_its_own_traceback_as_root_cause() -> None:
    t = feed_all(
        [
            "(Worker_TP0 pid=3) ERROR 11-29 16:40:09 [multiproc_executor.py:953] WorkerProc failed to start.",
            "(Worker_TP0 pid=3) ERROR 11-29 16:40:09 [multiproc_executor.py:953] Traceback (most recent call last):",
            "(Worker_TP0 pid=3) ERROR 11-29 16:40:09 [multiproc_executor.py:953] ValueError: Free memory on device "
            "cuda:0 (80.1/95.0 GiB) on startup is less than desired GPU memory utilization (0.95, 90.3 GiB).",
            "(EngineCore_DP0 pid=2) ERROR 11-29 16:40:09 [core.py:1510] EngineCore failed to start.",
            "(EngineCore_DP0 pid=2) ERROR 11-29 16:40:09 [core.py:1510] Exception: WorkerProc initialization failed "
            "due to an exception in a background process. See stack trace for root cause.",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    )
    assert (
        t.fatal_line
        == "(Worker_TP0 pid=3) ERROR 11-29 16:40:09 [multiproc_executor.py:953] WorkerProc failed to start."
    )
    assert t.fatal_rule == r"multiproc_executor.py: WorkerProc failed to start\."
    assert t.root_cause() == (
        "(Worker_TP0 pid=3) ERROR 11-29 16:40:09 [multiproc_executor.py:953] ValueError: Free memory on device "
        "cuda:0 (80.1/95.0 GiB) on startup is less than desired GPU memory utilization (0.95, 90.3 GiB)."
    )


def test_root_cause_without_a_fatal_line_prefers_the_exception_over_the_summary() -> None:
    t = feed_all(
        [
            "torch.OutOfMemoryError: CUDA error: out of memory on device 3",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    )
    assert t.fatal_line is None  # a traceback is never fatal: vLLM's exit ends the run
    assert t.root_cause() == "torch.OutOfMemoryError: CUDA error: out of memory on device 3"


# The real vLLM 0.32 record of each default rule (tests/fixtures/vllm_cpu_0.32), and its source file.
FATAL_RECORDS = [
    "(EngineCore pid=566) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
    "unexpectedly (exit code: -9), shutting down executor.",
    "(EngineCore pid=566) ERROR 11-29 17:08:21 [core.py:1512] EngineCore encountered a fatal error.",
    "(APIServer pid=942) ERROR 11-29 17:08:47 [async_llm.py:906] AsyncLLM output_handler failed.",
    "(Worker pid=2181) ERROR 11-29 17:10:10 [multiproc_executor.py:953] WorkerProc failed to start.",
    "(EngineCore pid=2152) ERROR 11-29 17:10:12 [core.py:1510] EngineCore failed to start.",
    "(Worker_TP1 pid=9) ERROR 11-29 17:10:12 [multiproc_executor.py:959] WorkerProc failed.",
    "(EngineCore_DP0 pid=9) ERROR 11-29 17:10:12 [ray_executor_v2.py:522] RayWorkerProc rank=[0, 1] died "
    "unexpectedly, shutting down executor.",
    # Bare (no process prefix), and with a relative path (VLLM_LOGGING_... relpath mode).
    "ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: -9)",
    "(EngineCore pid=5) ERROR 11-29 17:08:21 [v1/engine/core.py:1512] EngineCore encountered a fatal error.",
]


def test_a_real_fatal_record_from_its_file_fails_fast_before_and_after_ready() -> None:
    for line in FATAL_RECORDS:
        t = ReadinessTracker(CFG)
        assert t.feed(line).fatal, line
        assert t.fatal_line == line
        t = ReadinessTracker(CFG)
        t.serving = True
        assert t.feed(line).fatal, line


# What vLLM 0.32 logs at ERROR for a request: the client's model name inside serving.py's record (the issue's
# reproduction), a forged record after a newline in the model name (vLLM's formatter repeats serving.py's header
# on every line), the fatal words in another file's record, or after the message start.
CLIENT_ERROR_RECORDS = [
    "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] Error with model error=ErrorInfo(message='The model "
    "`EngineDeadError` does not exist.', type='NotFoundError', param='model', code=404)",
    "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] Error with model error=ErrorInfo(message='The model "
    "`Worker proc VllmWorker-0 died unexpectedly (exit code: -9)` does not exist.', type='NotFoundError')",
    "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] (EngineCore pid=1) ERROR 11-29 17:08:21 "
    "[core.py:1512] EngineCore encountered a fatal error.",
    "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] AsyncLLM output_handler failed.",
    "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] torch.OutOfMemoryError: CUDA out of memory.",
    "(EngineCore pid=2) ERROR 11-29 17:07:32 [core.py:2056] Unexpected error pre-processing request EngineCore "
    "encountered a fatal error.",
    "(Worker pid=3) ERROR 11-29 17:07:32 [multiproc_executor.py:1063] WorkerProc hit an exception. Worker proc x "
    "died unexpectedly",
    "ERROR:    Exception in ASGI application EngineDeadError died unexpectedly",
]


def test_client_text_in_an_error_record_or_a_traceback_is_never_fatal() -> None:
    """The issue's exit 13: a model name of `EngineDeadError` stopped a healthy server."""
    for line in CLIENT_ERROR_RECORDS:
        for serving in (False, True):
            t = ReadinessTracker(CFG)
            t.serving = serving
            assert not t.feed(line).fatal, line
            assert t.fatal_line is None
    t = ReadinessTracker(CFG)
    for line in [
        "Traceback (most recent call last):",
        '  File "/opt/kimi-vllm-venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in x',
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB.",
    ]:
        assert not t.feed(line).fatal, line


def test_user_rules_name_their_file() -> None:
    cfg = parse_config(
        {
            "child": {"argv": ["vllm"]},
            "readiness": {
                "fatal_patterns": [r"pynccl.py: NCCL (?:error|timeout)", r"custom_all_reduce.py: CUDA error"]
            },
        },
        Path("t.toml"),
    ).readiness
    t = ReadinessTracker(cfg)
    assert not t.feed("(Worker_TP3 pid=9) ERROR 11-29 17:08:21 [x.py:1] NCCL timeout after 1800 s").fatal
    assert not t.feed("(Worker_TP3 pid=9) ERROR 11-29 17:08:21 [pynccl.py:1] worker 3: NCCL timeout").fatal
    assert t.feed("(Worker_TP3 pid=9) ERROR 11-29 17:08:21 [pynccl.py:1] NCCL timeout after 1800 s").fatal
    assert (
        not ReadinessTracker(cfg)
        .feed("(Worker pid=9) WARNING 11-29 17:08:21 [custom_all_reduce.py:1] CUDA error")
        .fatal
    )


def test_tail_is_bounded() -> None:
    t = feed_all([f"line {i}" for i in range(1000)])
    assert len(t.tail) == 40 and t.tail[-1] == "line 999"


def test_prefilter_words_are_required_by_each_pattern() -> None:
    from kimi_supervisor.child.readiness import literal_prefilter

    assert literal_prefilter([r"Starting vLLM (?:API )?server", r"torch\.compile|colou?r"]) is not None
    rx = literal_prefilter([r"Starting vLLM (?:API )?server", r"torch\.compile|colou?r"])
    assert rx is not None and rx.pattern == "Starting|colo|torch"
    assert literal_prefilter([r"(?i)error"]) is None  # flags: no safe literal
    assert literal_prefilter([r"\d+ ok"]) is None  # no word of 4 letters: always run the full search


# Real vLLM 0.32 line shapes (tests/fixtures/vllm_cpu_0.32): the access line is uvicorn's, bare, on stdout.
HOSTILE_REQUESTS = [
    'INFO:     1.2.3.4:5 - "GET /EngineDeadError HTTP/1.1" 404 Not Found',
    'INFO:     1.2.3.4:5 - "GET /Worker%20died%20unexpectedly HTTP/1.1" 404 Not Found',
    'INFO:     ::1:5 - "POST /v1/completions?x=CUDA+out+of+memory HTTP/1.1" 400 Bad Request',
    '(APIServer pid=7) INFO 11-29 17:07:32 [h11_impl.py:473] 1.2.3.4:5 - "GET /EngineDeadError HTTP/1.1" 404',
]


def test_client_text_never_fails_the_run() -> None:
    """A request path, a prompt echoed in an INFO record, a DEBUG record: none is fatal, before or after ready."""
    for line in [
        *HOSTILE_REQUESTS,
        "(APIServer pid=7) INFO 11-29 17:07:32 [logger.py:39] Received request cmpl-1: prompt: 'EngineDeadError'",
        "(APIServer pid=7) DEBUG 11-29 17:07:32 [x.py:1] EngineCore encountered a fatal error (a prompt)",
        "(APIServer pid=7) WARNING 11-29 17:07:32 [x.py:1] bad request: 'died unexpectedly'",
    ]:
        t = ReadinessTracker(CFG)
        assert not t.feed(line).fatal, line
        assert t.fatal_line is None
        t.serving = True
        assert not t.feed(line).fatal, line


def test_a_request_cannot_fake_readiness_or_progress() -> None:
    t = ReadinessTracker(CFG)
    for line in [
        'INFO:     1.2.3.4:5 - "GET /Application%20startup%20complete. HTTP/1.1" 404 Not Found',
        'INFO:     1.2.3.4:5 - "GET /Application startup complete. HTTP/1.1" 404 Not Found',
        'INFO:     1.2.3.4:5 - "GET /Starting%20vLLM%20server%20on HTTP/1.1" 404 Not Found',
        'INFO:     1.2.3.4:5 - "GET /Loading%20safetensors%20checkpoint%20shards:%2050%25%20Completed HTTP/1.1" 404',
    ]:
        event = t.feed(line)
        assert not event.started and not event.phase_changed, line
    assert not t.server_started and t.phase == "spawning"
    assert t.feed("INFO:     Application startup complete.").started  # the server's own record still counts


def test_a_clients_words_in_an_error_record_are_never_the_root_cause() -> None:
    """A real engine death after a request whose model name reads like an exception: the cause is vLLM's."""
    t = feed_all(
        [
            "(APIServer pid=7) ERROR 11-29 17:07:32 [serving.py:274] Error with model error=ErrorInfo(message='The "
            "model `RuntimeError: GPU melted, call +1-555` does not exist.', type='NotFoundError', code=404)",
            "(APIServer pid=7) ERROR 11-29 17:08:47 [async_llm.py:906] AsyncLLM output_handler failed.",
            "(APIServer pid=7) ERROR 11-29 17:08:47 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        ]
    )
    assert t.fatal_line == "(APIServer pid=7) ERROR 11-29 17:08:47 [async_llm.py:906] AsyncLLM output_handler failed."
    assert "melted" not in t.root_cause()


def test_a_fatal_line_that_says_what_happened_stays_the_root_cause() -> None:
    died = (
        "(EngineCore pid=566) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
        "unexpectedly (exit code: -9), shutting down executor."
    )
    later = "(EngineCore pid=566) ERROR 11-29 17:08:22 [multiproc_executor.py:400] RuntimeError: cleanup failed"
    t = feed_all([died, later])
    assert t.root_cause() == died
