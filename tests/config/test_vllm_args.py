"""What the supervisor reads from the child's argv: model, health URL, TP size, memory fraction."""

from __future__ import annotations

import pytest

from kimi_supervisor.config.vllm_args import parse_vllm_args


def test_seeds_argv() -> None:
    a = parse_vllm_args(
        [
            "/root/ml-env/bin/python3",
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            "/shared/kimi-k2.5-nvfp4",
            "--tensor-parallel-size",
            "8",
            "--gpu-memory-utilization",
            "0.95",
            "--max-model-len",
            "131072",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
        ]
    )
    assert (a.model, a.tensor_parallel_size, a.gpu_memory_utilization) == ("/shared/kimi-k2.5-nvfp4", 8, 0.95)
    assert a.health_url == "http://127.0.0.1:8000/health"


def test_defaults_and_equals_forms() -> None:
    a = parse_vllm_args(["vllm", "serve", "m"])
    assert (a.host, a.port, a.tensor_parallel_size, a.gpu_memory_utilization) == ("0.0.0.0", 8000, 1, 0.92)
    b = parse_vllm_args(
        ["python", "-m", "vllm.entrypoints.openai.api_server", "--model=/m", "-tp", "2", "--port=9001", "--host=::1"]
    )
    assert (b.model, b.tensor_parallel_size, b.health_url) == ("/m", 2, "http://[::1]:9001/health")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["vllm", "serve", "m", "--port"], "option --port has no value"),
        (["vllm", "serve", "m", "--port", "0"], "--port expects 1..65535, got 0"),
        (["vllm", "serve", "m", "-tp", "0"], "--tensor-parallel-size expects >= 1, got 0"),
        (["vllm", "serve", "m", "-tp", "two"], "--tensor-parallel-size expects an integer, got 'two'"),
        (["vllm", "serve", "m", "--gpu-memory-utilization", "x"], "--gpu-memory-utilization expects a number, got 'x'"),
    ],
)
def test_bad_values(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_vllm_args(argv)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("argv", "seconds"),
    [
        (["vllm", "serve", "m"], 0),
        (["vllm", "serve", "m", "--shutdown-timeout", "300"], 300),
        (["vllm", "serve", "m", "--shutdown-timeout=45", "--port", "9000"], 45),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--shutdown-timeout", "0"], 0),
    ],
)
def test_shutdown_timeout(argv: list[str], seconds: int) -> None:
    a = parse_vllm_args(argv)
    assert a.shutdown_timeout == seconds and a.drains is (seconds > 0)
    assert a.model in ("m", "/m")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("30.5", "expects an integer number of seconds, got '30.5'"),
        ("-1", "expects >= 0 seconds, got -1"),
        ("x", "expects an integer number of seconds, got 'x'"),
    ],
)
def test_bad_shutdown_timeout(value: str, why: str) -> None:
    with pytest.raises(ValueError, match="--shutdown-timeout " + why.replace(".", r"\.")):
        parse_vllm_args(["vllm", "serve", "m", f"--shutdown-timeout={value}"])
    with pytest.raises(ValueError, match="--shutdown-timeout"):
        parse_vllm_args(["vllm", "serve", "m", "--shutdown-timeout"])
