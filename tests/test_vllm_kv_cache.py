"""Every `vllm serve` the real-vLLM tiers start asks for the small KV cache (testkit/vllm_serve.py, KV_CACHE_ARGS)
and nothing in its environment overrides it: VLLM_CPU_KVCACHE_SPACE, when set, wins over --kv-cache-memory-bytes
(vllm/platforms/cpu.py) and allocates whole GiB at each start (docs/history/test-suite-speed.md, "One vLLM start")."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from testkit.vllm_serve import KV_CACHE_BYTES, VENV, long_generation_argv
from tests.e2e import group_config, test_vllm_cache, test_vllm_cpu
from tests.e2e.netpair import NetPair

VLLM = VENV / "bin" / "vllm"
MODEL = Path("/nonexistent/tiny")


def kv_bytes(argv: list[str]) -> int:
    assert argv.count("--kv-cache-memory-bytes") == 1, argv
    return int(argv[argv.index("--kv-cache-memory-bytes") + 1])


def child(config: Path) -> tuple[list[str], dict[str, str]]:
    table = tomllib.loads(config.read_text())["child"]
    return list(table["argv"]), dict(table["env"])


@pytest.mark.parametrize("which", ["cpu", "cache"])
def test_the_single_server_configs_ask_for_the_small_kv_cache(tmp_path: Path, which: str) -> None:
    if which == "cpu":
        config = test_vllm_cpu.vllm_config(tmp_path, VLLM, MODEL, 8000)
    else:
        config = test_vllm_cache.config(tmp_path, tmp_path / "cache", MODEL, 8000)
    argv, env = child(config)
    assert kv_bytes(argv) == KV_CACHE_BYTES
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


@pytest.mark.parametrize("rank", [0, 1])
def test_each_group_node_asks_for_the_small_kv_cache(rank: int) -> None:
    sections = group_config.node_sections(
        VLLM, MODEL, NetPair("10.99.0", ""), rank, api_port=1, master_port=2, ready_s=1
    )
    assert kv_bytes(sections["child"]["argv"]) == KV_CACHE_BYTES
    assert "VLLM_CPU_KVCACHE_SPACE" not in sections["child"]["env"]


@pytest.mark.parametrize("shutdown_timeout", [None, 60])
def test_the_drain_argv_asks_for_the_small_kv_cache_with_room_for_two_long_generations(
    shutdown_timeout: int | None,
) -> None:
    argv = long_generation_argv(VLLM, MODEL, 8000, shutdown_timeout)
    max_len = int(argv[argv.index("--max-model-len") + 1])
    # 2 KiB a token for the tiny model (tests/e2e/make_tiny_model.py): vLLM refuses to start when one request of
    # --max-model-len does not fit.
    assert kv_bytes(argv) == KV_CACHE_BYTES >= 2 * max_len * 2048
