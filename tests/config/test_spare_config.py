"""A hot spare's config (docs/spare.md, config/spare.py): its child is its engine's, only its socket and memory flags
its own; a spare whose tokens could differ from its engine's is refused, exit 78, one line naming file, key, value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_supervisor.config.gpu_pinning import NCCL_RAS_ADDR
from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.spare import output_key
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.roles import Role
from testkit.harness import short_link
from tests.config.config_text import error_of, load

SPARE = (
    '[deployment]\nname = "kimi"\nrole = "spare"\n'
    "[spare]\nkv_cache_memory_bytes = 4294967296\ngpu_memory_utilization = 0.3\n"
)


def engine_text(tmp_path: Path, *extra: str, holder: bool = True, gpus: str = "[0, 1]") -> str:
    run = short_link(tmp_path / "run")  # the holder's socket paths under it must fit a Unix socket
    extra_config = json.dumps(
        {"socket_dir": str(run / "kimi" / "weight-cache"), "mode": "zero_copy", "fallback": False}
    )
    argv = ["vllm", "serve", "/m", "-tp", "2", "--max-model-len", "8192", "--reasoning-parser", "kimi_k2"]
    argv += ["--uds", str(run / "kimi" / "front" / "engine.sock"), "--enable-scale-out"]
    argv += ["--gpu-memory-utilization", "0.8", "--load-format", "ipc_cache", "--model-loader-extra-config"]
    argv += [extra_config, *extra]
    return (
        f'[deployment]\nname = "kimi"\n[paths]\nruntime_directory = "{run}"\nstate_directory = "{tmp_path / "lib"}"\n'
        f'[child]\nargv = {json.dumps(argv)}\nenv = {{ NCCL_PROTO = "LL" }}\nuser = "nobody"\n'
        f"[preflight]\ngpus = {gpus}\n[weights]\nholder = {str(holder).lower()}\n"
    )


def spare_of(tmp_path: Path, engine: str, spare: str = SPARE):  # type: ignore[no-untyped-def]
    (tmp_path / "kimi.toml").write_text(engine)
    return load(tmp_path, spare, "kimi.spare.toml")


def refusal(tmp_path: Path, engine: str, spare: str = SPARE) -> str:
    (tmp_path / "kimi.toml").write_text(engine)
    return error_of(tmp_path, spare, "kimi.spare.toml").replace("{p}", "T/kimi.spare.toml").replace(str(tmp_path), "T")


def test_a_spares_argv_is_its_engines_with_its_own_socket_and_memory_flags(tmp_path: Path) -> None:
    text = engine_text(tmp_path)
    engine = load(tmp_path, text, "kimi.toml")
    cfg = spare_of(tmp_path, text)
    assert cfg.role is Role.SPARE and cfg.spare is not None
    socket = str(Path(str(engine.child.vllm.uds)).with_name("spare.sock"))
    # The engine's every flag, in its order; its socket and its fraction replaced by the spare's own.
    kept = [
        a for a in engine.child.argv if a not in ("--uds", engine.child.vllm.uds, "--gpu-memory-utilization", "0.8")
    ]
    assert list(cfg.child.argv) == [
        *kept,
        "--uds",
        socket,
        "--kv-cache-memory-bytes",
        "4294967296",
        "--gpu-memory-utilization",
        "0.3",
    ]
    assert cfg.child.vllm.uds == socket and cfg.readiness.health_url.endswith("spare.sock/health")
    assert (cfg.child.user, cfg.preflight.gpus, cfg.paths) == (engine.child.user, (0, 1), engine.paths)
    assert cfg.weights is not None and cfg.weights.key == engine.weights.key  # type: ignore[union-attr]
    # Its own NCCL RAS port, beside the engine's and the holder's: locked, so the same one would refuse with 16.
    ports = {engine.child.env[NCCL_RAS_ADDR], cfg.child.env[NCCL_RAS_ADDR]}
    assert len(ports) == 2 and cfg.child.env["NCCL_PROTO"] == "LL"
    # What decides its tokens hashes equal to its engine's.
    assert cfg.spare.output_key == output_key(engine.child.argv, dict(engine.child.env))
    assert cfg.spare.engine_gpu_memory_utilization == 0.8 and cfg.spare.engine_kv_cache_memory_bytes is None


def test_the_engines_own_kv_bytes_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    cfg = spare_of(tmp_path, engine_text(tmp_path, "--kv-cache-memory-bytes", "20G"))
    assert cfg.spare is not None and cfg.spare.engine_kv_cache_memory_bytes == 20 << 30
    assert cfg.child.argv.count("--kv-cache-memory-bytes") == 1  # the engine's replaced by the spare's


@pytest.mark.parametrize(
    ("engine_extra", "spare_text", "expected"),
    [
        (
            {"holder": False},
            SPARE,
            "T/kimi.toml: weights.holder: false: a spare maps its engine's held weights",
        ),
        (
            {"extra": ("--max-model-len", "auto")},
            SPARE,
            "T/kimi.toml: child.argv: --max-model-len 'auto': vLLM fits it to each engine's KV cache",
        ),
        (
            {},
            SPARE + '[child]\nargv = ["vllm", "serve", "/other"]\n',
            "T/kimi.spare.toml: child: deployment.role = 'spare' runs its engine's child",
        ),
        (
            {},
            SPARE + "[preflight]\ngpus = [2, 3]\n",
            "T/kimi.spare.toml: preflight.gpus: [2, 3]: the spare runs on its engine's GPUs (T/kimi.toml: [0, 1])",
        ),
        (
            {},
            SPARE.replace("kv_cache_memory_bytes = 4294967296\n", ""),
            "T/kimi.spare.toml: spare.kv_cache_memory_bytes: required key is missing",
        ),
        (
            {},
            SPARE.replace("gpu_memory_utilization = 0.3\n", ""),
            "T/kimi.spare.toml: spare.gpu_memory_utilization: required key is missing",
        ),
        (
            {},
            SPARE + "max_model_len = 4096\n",
            "T/kimi.spare.toml: spare.max_model_len: unknown key",
        ),
        (
            {},
            SPARE + "[weights]\nholder = true\n",
            "T/kimi.spare.toml: weights: deployment.role = 'spare' does not read [weights]",
        ),
    ],
)
def test_a_spare_whose_tokens_could_differ_is_refused_naming_file_key_value(
    tmp_path: Path, engine_extra: dict[str, object], spare_text: str, expected: str
) -> None:
    extra = engine_extra.get("extra", ())
    engine = engine_text(tmp_path, *extra, holder=bool(engine_extra.get("holder", True)))  # type: ignore[arg-type]
    assert refusal(tmp_path, engine, spare_text).startswith(expected)


def test_a_spare_without_its_engines_config_is_refused(tmp_path: Path) -> None:
    message = error_of(tmp_path, SPARE, "kimi.spare.toml").replace("{p}", "T/kimi.spare.toml")
    message = message.replace(str(tmp_path), "T")
    assert message == (
        "T/kimi.spare.toml: deployment.name: 'kimi': a spare runs its engine's argv, and its engine's config "
        "T/kimi.toml is not there"
    )


def test_a_spare_table_is_refused_in_every_other_role(tmp_path: Path) -> None:
    text = engine_text(tmp_path) + "[spare]\nkv_cache_memory_bytes = 4294967296\n"
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, "kimi.toml")
    assert info.value.exit_code == ExitCode.CONFIG and "does not read [spare]" in info.value.message


def test_the_example_spare_loads_beside_its_engine_and_its_plan_fits_an_rtx_pro_6000() -> None:
    """etc/spare/: the engine, its spare and its front of one deployment; the spare's memory plan with the seeds'
    weights (540 GB over 8 GPUs, ~64400 MiB each) fits a 97887 MiB GPU."""
    from kimi_supervisor.host.gpu import GpuMemory
    from kimi_supervisor.preflight.memory_plan import plan

    etc = Path(__file__).resolve().parents[2] / "etc" / "spare"
    engine, spare = load_config(etc / "kimi.toml"), load_config(etc / "kimi.spare.toml")
    front = load_config(etc / "kimi.front.toml")
    assert spare.role is Role.SPARE and spare.spare is not None and front.front is not None
    assert front.front.spare_socket is not None and str(front.front.spare_socket) == spare.child.vllm.uds
    assert spare.spare.output_key == output_key(engine.child.argv, dict(engine.child.env))
    check = plan([GpuMemory(i, 97887, 0, 97887) for i in range(8)], dict.fromkeys(range(8), 64400), "w", spare.spare)
    assert check.verdict.value == "ok", check.message
