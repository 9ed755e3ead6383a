"""The weight holder's config checks against vLLM 0.32's own code (issue 38): its socket path, as the daemon
binds it (weight_cache/protocol.py get_socket_path), is the one config/weights.py measures."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kimi_supervisor.config.weights import longest_socket_path
from testkit.vllm_serve import VENV

PROBE = """
import json, sys
from vllm.model_executor.model_loader.weight_cache.protocol import get_socket_path
d = sys.argv[1]
print(json.dumps([get_socket_path("GPU-0e3b7c1a-aaaa-bbbb-cccc-0123456789ab", d, is_draft=x) for x in (False, True)]))
"""


def test_socket_paths_are_as_long_as_vllms_own(vllm_bin: Path) -> None:
    sockets = Path("/run/kimi-supervisor/abcdefghijklmnopq/weight-cache")
    result = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", PROBE, str(sockets)], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    target, draft = json.loads(result.stdout.strip().splitlines()[-1])
    spec = ["--speculative-config", json.dumps({"method": "mtp"})]
    assert len(longest_socket_path(sockets, ["vllm", "preload"])) == len(target) == 107
    assert len(longest_socket_path(sockets, ["vllm", "preload", *spec])) == len(draft) == 113
