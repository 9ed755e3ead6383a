"""Child line classification: priority and vLLM fields from real line shapes."""

from __future__ import annotations

import pytest

from kimi_supervisor.child.lines import LineClassifier


@pytest.mark.parametrize(
    ("line", "priority", "fields"),
    [
        (
            "(APIServer pid=213806) INFO 02-20 22:24:20 [launcher.py:47] Route: /v1/completions, Methods: POST",
            6,
            {"VLLM_COMPONENT": "APIServer", "VLLM_PID": "213806"},
        ),
        (
            "(EngineCore_DP0 pid=213990) WARNING 02-20 22:16:01 [core.py:1] slow",
            4,
            {"VLLM_COMPONENT": "EngineCore", "VLLM_RANK": "0", "VLLM_PID": "213990"},
        ),
        (
            "(Worker_TP3 pid=214001) ERROR 02-20 22:16:01 [worker.py:9] bad",
            3,
            {"VLLM_COMPONENT": "Worker", "VLLM_RANK": "3", "VLLM_PID": "214001"},
        ),
        (
            "(VllmWorker TP3 pid=77) INFO 02-20 22:16:01 [x.py:1] older prefix",
            6,
            {"VLLM_COMPONENT": "VllmWorker", "VLLM_RANK": "3", "VLLM_PID": "77"},
        ),
        ("INFO:     Application startup complete.", 6, {}),
        ("WARNING 02-20 22:16:01 [config.py:1] unprefixed vLLM warning", 4, {}),
        ("ERROR:    Traceback-free uvicorn error", 3, {}),
        ("Loading safetensors checkpoint shards:  57% Completed | 68/119 [04:12<03:10,  1.2s/it]", 6, {}),
        ("RuntimeError: Engine core initialization failed. See root cause above.", 3, {}),
    ],
)
def test_classify(line: str, priority: int, fields: dict[str, str]) -> None:
    assert LineClassifier().classify(line) == (priority, fields)


def test_traceback_lines_are_errors_until_the_exception_line() -> None:
    c = LineClassifier()
    lines = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "    boom()",
        "ValueError: nope",
        "INFO 02-20 22:16:01 [x.py:1] back to normal",
    ]
    assert [c.classify(line)[0] for line in lines] == [3, 3, 3, 3, 6]
