"""[weights]: the holder's argv completed and checked, the engine's required to map it without a fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.weights import READY_PATTERN, key_mismatch, weights_key
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.roles import Role


def holder_text(tmp_path: Path, argv: list[str], extra: str = "") -> str:
    return (
        f'[child]\nargv = {json.dumps(argv)}\n[deployment]\nname = "kimi"\nrole = "weights"\n'
        f'[paths]\nruntime_directory = "{tmp_path}/run"\nstate_directory = "{tmp_path}/lib"\n{extra}'
    )


def engine_text(tmp_path: Path, argv: list[str], extra: str = "[weights]\nholder = true\n") -> str:
    return (
        f'[child]\nargv = {json.dumps(argv)}\n[deployment]\nname = "kimi"\n'
        f'[paths]\nruntime_directory = "{tmp_path}/run"\nstate_directory = "{tmp_path}/lib"\n{extra}'
    )


def load(tmp_path: Path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "kimi.toml"
    path.write_text(text)
    return load_config(path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert info.value.exit_code == ExitCode.CONFIG and "\n" not in info.value.message
    return info.value.message.replace(str(tmp_path), "{t}")


PRELOAD = ["vllm", "preload", "--model", "/m", "-tp", "8"]


def engine_argv(tmp_path: Path, **extra: object) -> list[str]:
    conf: dict[str, object] = {
        "socket_dir": f"{tmp_path}/run/kimi/weight-cache",
        "mode": "zero_copy",
        "fallback": False,
    }
    conf.update(extra)
    return [
        "vllm",
        "serve",
        "/m",
        "-tp",
        "8",
        "--load-format",
        "ipc_cache",
        "--model-loader-extra-config",
        json.dumps(conf),
    ]


def test_holder_gets_socket_dir_under_runtime_and_loopback_health(tmp_path: Path) -> None:
    cfg = load(tmp_path, holder_text(tmp_path, PRELOAD, "[weights]\nhealth_port = 8111\n"))
    assert cfg.role is Role.WEIGHTS and cfg.weights is not None
    sockets = str(tmp_path / "run" / "kimi" / "weight-cache")
    assert cfg.child.argv[len(PRELOAD) :] == (
        "--weight-cache-socket-dir", sockets,
        "--weight-cache-health-port", "8111",
        "--weight-cache-health-host", "127.0.0.1",
    )  # fmt: skip
    # Ready = vLLM's READY line and /health 200 on the holder's port; no canary, no token-progress check.
    assert cfg.readiness.health_url == "http://127.0.0.1:8111/health" and cfg.child.vllm.port == 8111
    assert [p.pattern for p in cfg.readiness.started_patterns] == [READY_PATTERN]
    assert cfg.readiness.started_patterns[0].search(
        "===== Weight cache daemon READY: node 0/1 serving 8 local rank(s) x 1 role(s) in /run/x ====="
    )
    assert cfg.liveness.canary_interval_s == 0 and cfg.liveness.stuck_after_s == 0
    assert cfg.weights.key["tensor_parallel_size"] == "8" and cfg.weights.key["model"] == "/m"


def test_holder_argv_port_is_taken_when_the_key_is_absent(tmp_path: Path) -> None:
    cfg = load(tmp_path, holder_text(tmp_path, [*PRELOAD, "--weight-cache-health-port", "8123"]))
    assert cfg.readiness.health_url == "http://127.0.0.1:8123/health"


@pytest.mark.parametrize(
    ("argv", "extra", "expected"),
    [
        (["vllm", "serve", "/m"], "", "child.argv: deployment.role = \"weights\" runs vLLM's weight holder"),
        ([*PRELOAD, "--load-format", "ipc_cache"], "", "child.argv: --load-format ipc_cache: the weight"),
        ([*PRELOAD, "--weight-cache-socket-dir", "/tmp/wc"], "",
         "child.argv: --weight-cache-socket-dir '/tmp/wc': expected '{t}/run/kimi/weight-cache'"),
        ([*PRELOAD, "--weight-cache-health-port", "9"], "[weights]\nhealth_port = 10\n",
         "weights.health_port: 10, but child.argv has --weight-cache-health-port 9"),
        (PRELOAD, "[weights]\nholder = true\n", "weights.holder: is for the engine"),
    ],
)  # fmt: skip
def test_holder_refusals(tmp_path: Path, argv: list[str], extra: str, expected: str) -> None:
    assert error_of(tmp_path, holder_text(tmp_path, argv, extra)).startswith("{t}/kimi.toml: " + expected)


def test_engine_with_holder(tmp_path: Path) -> None:
    cfg = load(tmp_path, engine_text(tmp_path, engine_argv(tmp_path), "[weights]\nholder = true\nwait_s = 60\n"))
    assert cfg.maps_held_weights and cfg.weights is not None and cfg.weights.wait_s == 60
    assert cfg.weights.socket_dir == tmp_path / "run" / "kimi" / "weight-cache"
    # No [weights], or holder = false: a plain engine, whatever its argv.
    assert load(tmp_path, engine_text(tmp_path, ["vllm", "serve", "/m"], "")).weights is None
    assert load(tmp_path, engine_text(tmp_path, ["vllm", "serve", "/m"], "[weights]\nholder = false\n")).weights is None


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda a: a[:5],
         "weights.holder: true, but child.argv has no --load-format: child.argv needs --load-format ipc_cache"),
        (lambda a: [*a[:6], "auto", *a[7:]], "weights.holder: true, but child.argv has --load-format 'auto'"),
        (lambda a: a[:7], "weights.holder: true, but child.argv has no --model-loader-extra-config"),
        (lambda a: [*a[:8], "{bad"], "child.argv: --model-loader-extra-config is not JSON"),
    ],
)  # fmt: skip
def test_engine_refusals(tmp_path: Path, mutate, expected: str) -> None:  # type: ignore[no-untyped-def]
    message = error_of(tmp_path, engine_text(tmp_path, mutate(engine_argv(tmp_path))))
    assert message.startswith("{t}/kimi.toml: " + expected), message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"fallback": True}, '"fallback" is true: expected false'),
        ({"fallback": None}, '"fallback" is null: expected false'),
        ({"socket_dir": "/tmp/wc"}, '"socket_dir" is "/tmp/wc": expected "{t}/run/kimi/weight-cache"'),
        ({"mode": "mmap"}, '"mode" is "mmap": expected "zero_copy"'),
    ],
)
def test_engine_extra_config_refusals(tmp_path: Path, extra: dict[str, object], expected: str) -> None:
    message = error_of(tmp_path, engine_text(tmp_path, engine_argv(tmp_path, **extra)))
    assert message.startswith("{t}/kimi.toml: child.argv: --model-loader-extra-config " + expected), message


def test_engine_without_fallback_key_is_refused(tmp_path: Path) -> None:
    argv = engine_argv(tmp_path)
    conf = json.loads(argv[-1])
    del conf["fallback"]  # vLLM's default is true
    argv[-1] = json.dumps(conf)
    assert '"fallback" is "unset (true)"' in error_of(tmp_path, engine_text(tmp_path, argv))


def test_weights_key_matches_holder_and_engine_and_names_the_difference() -> None:
    holder = weights_key(["vllm", "preload", "--model", "/m", "--tensor-parallel-size=8", "--dtype", "bfloat16"])
    engine = weights_key(["vllm", "serve", "/m", "-tp", "8", "--dtype", "bfloat16"])
    assert key_mismatch(dict(holder), engine) == []
    other = weights_key(["vllm", "serve", "/m2", "-tp", "4", "--dtype", "bfloat16", "--quantization", "fp8"])
    assert key_mismatch(dict(holder), other) == [
        "model: holder '/m', engine '/m2'",
        "tensor_parallel_size: holder '8', engine '4'",
        "quantization: holder None, engine 'fp8'",
    ]


def test_the_example_pair_loads_and_agrees() -> None:
    """etc/weights/: the holder and its engine of one deployment, of one cache key and one socket directory."""
    etc = Path(__file__).resolve().parents[2] / "etc" / "weights"
    holder, engine = load_config(etc / "kimi.weights.toml"), load_config(etc / "kimi.toml")
    assert holder.role is Role.WEIGHTS and engine.maps_held_weights
    assert holder.deployment.name == engine.deployment.name == "kimi"
    assert holder.weights is not None and engine.weights is not None
    assert holder.weights.socket_dir == engine.weights.socket_dir == Path("/run/kimi-supervisor/kimi/weight-cache")
    assert key_mismatch(dict(holder.weights.key), dict(engine.weights.key)) == []
