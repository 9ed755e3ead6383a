"""[weights]: the holder's argv completed and checked, the engine's required to map it without a fallback."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.weights import READY_PATTERN, key_mismatch, weights_key
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.roles import Role


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory instead of pytest's: vLLM's socket paths under it must fit a Unix socket (107 bytes)."""
    made = Path(tempfile.mkdtemp(prefix="kw-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


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


def sized(tmp_path: Path, role: str, name: str, argv_extra: list[str] | None = None) -> str:
    """A holder's or engine's config whose runtime directory is /run/kimi-supervisor, as the unit's default."""
    run = "/run/kimi-supervisor"
    if role == "holder":
        text = holder_text(tmp_path, [*PRELOAD, *(argv_extra or [])])
    else:
        argv = [*engine_argv(tmp_path), *(argv_extra or [])]
        argv = [a.replace(f"{tmp_path}/run/kimi/", f"{run}/{name}/") for a in argv]
        text = engine_text(tmp_path, argv)
    return text.replace(f"{tmp_path}/run", run).replace('name = "kimi"', f'name = "{name}"')


SPEC = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]


@pytest.mark.parametrize(
    ("role", "extra", "longest_ok"),
    [
        ("holder", [], 17),
        ("engine", [], 17),
        ("holder", SPEC, 11),
        ("engine", SPEC, 11),
        ("holder", ["--spec-method", "eagle3"], 11),
        ("holder", ["--speculative-config", '{"method": "ngram"}'], 17),  # not cached: no draft group
    ],
)
def test_socket_path_longer_than_a_unix_socket_is_refused_at_load(
    tmp_path: Path, role: str, extra: list[str], longest_ok: int
) -> None:
    """vLLM binds <dir>/vllm_weight_cache_<md5 of the GPU uuid>[_draft].sock only after its full load: a path over
    107 bytes (90 + len(NAME) in the default runtime directory, 96 + len(NAME) with a draft group) must be refused
    when the config is read, naming the key and the length."""
    assert load(tmp_path, sized(tmp_path, role, "k" * longest_ok, extra)).weights is not None
    message = error_of(tmp_path, sized(tmp_path, role, "k" * (longest_ok + 1), extra))
    assert "kimi.toml: deployment.name: the weight holder's sockets would be 108 bytes long" in message, message
    assert "over the 107 a Unix socket allows: shorten deployment.name" in message
    assert ("_draft.sock" in message) == (longest_ok == 11)


def test_socket_path_check_follows_vllms_sha256_fallback_on_a_fips_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where OpenSSL refuses md5 (FIPS), vLLM's safe_hash falls back to sha256: 64 hex digits, not 32."""
    assert load(tmp_path, sized(tmp_path, "holder", "kimi")).weights is not None

    def no_md5(*args: object, **kwargs: object) -> object:
        raise ValueError("[digital envelope routines] unsupported")

    monkeypatch.setattr(hashlib, "md5", no_md5)
    message = error_of(tmp_path, sized(tmp_path, "holder", "kimi"))
    assert "sockets would be 126 bytes long" in message, message


def test_copy_mode_is_refused_naming_the_key(tmp_path: Path) -> None:
    """ "copy": vLLM credits nothing held and releases the daemon's weights after the copy, so no later start
    could map them: refused at load (78), naming the key."""
    message = error_of(tmp_path, engine_text(tmp_path, engine_argv(tmp_path, mode="copy")))
    assert message.startswith(
        '{t}/kimi.toml: child.argv: --model-loader-extra-config "mode" is "copy": expected "zero_copy"'
    ), message


def test_weights_key_compares_parsed_values_as_vllm_keys_them(tmp_path: Path) -> None:
    """vLLM keys on the resolved torch dtype and integer sizes: `auto` on a bfloat16 checkpoint is bfloat16,
    `half` is float16, `-tp 08` is 8.  Expert parallelism lays the experts out differently: a difference."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    holder = weights_key(["vllm", "preload", "--model", str(model), "-tp", "8", "--dtype", "bfloat16"])
    assert key_mismatch(dict(holder), weights_key(["vllm", "serve", str(model), "-tp", "08"])) == []
    assert key_mismatch(dict(holder), weights_key(["vllm", "serve", str(model), "--tensor-parallel-size=8"])) == []
    assert key_mismatch(dict(holder), weights_key(["vllm", "serve", str(model), "-tp", "8", "-ep"])) == [
        "expert_parallel: holder 'false', engine 'true'"
    ]
    assert key_mismatch(dict(holder), weights_key(["vllm", "serve", str(model), "-tp", "8", "--dtype", "half"])) == [
        "dtype: holder 'bfloat16', engine 'float16'"
    ]
    assert weights_key(["vllm", "serve", "/m", "--dtype", "half"])["dtype"] == "float16"
    (model / "config.json").write_text(json.dumps({"text_config": {"dtype": "float32"}}))
    assert weights_key(["vllm", "serve", str(model)])["dtype"] == "bfloat16"  # float32 downcast on CUDA


def fake_venv(root: Path, version: str) -> Path:
    meta = root / "lib" / "python3.11" / "site-packages" / "vllm-0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    exe = root / "bin" / "vllm"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


def test_weights_key_has_the_venvs_vllm_version(tmp_path: Path) -> None:
    """vLLM's key has vllm.version.__version__: a venv upgraded under a live holder is a mismatch."""
    exe = fake_venv(tmp_path / "venv", "0.32.0+cpu")
    holder = weights_key([str(exe), "preload", "--model", "/m"])
    assert holder["vllm_version"] == "0.32.0"
    fake_venv(tmp_path / "venv", "0.33.1")
    assert key_mismatch(dict(holder), weights_key([str(exe), "serve", "/m"])) == [
        "vllm_version: holder '0.32.0', engine '0.33.1'"
    ]
    # A holder recorded by a supervisor from before the field: not counted as a difference.
    older = {k: v for k, v in holder.items() if k != "vllm_version"}
    assert key_mismatch(older, weights_key([str(exe), "serve", "/m"])) == []


def test_holder_stalls_only_past_its_deadline_since_its_ranks_print_nothing(tmp_path: Path) -> None:
    """vLLM's daemon ranks never set its logging up: from the launch line to READY (a full load, ~9 min) the
    holder prints nothing, so the default stall timeout (300 s) would kill every load: the deadline bounds it."""
    cfg = load(tmp_path, holder_text(tmp_path, PRELOAD))
    assert cfg.readiness.stall_timeout_s == cfg.readiness.deadline_s == 1800
    given = load(tmp_path, holder_text(tmp_path, PRELOAD, "[readiness]\nstall_timeout_s = 60\n"))
    assert given.readiness.stall_timeout_s == 60
