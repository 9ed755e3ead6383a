"""Client text is never a verdict: requests whose model name or prompt spells vLLM's fatal messages.

vLLM 0.32 answers a chat completion for an unknown model with a 404 and logs, at ERROR,
`[serving.py:274] Error with model error=ErrorInfo(message='The model `EngineDeadError` does not exist.' ...)`:
the client's words in a server ERROR record. Before the fix that record matched `EngineDeadError` and the
healthy server was stopped (exit 13) 0.4 s after the request.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from testkit.harness import Run, free_port
from tests.conftest import wait_for
from tests.e2e.test_vllm_cpu import health_status, tree_of, vllm_config

# Each a model name (the 404 path logs it at ERROR) or a prompt; the last forges a whole engine record after
# a newline: vLLM's formatter gives the continuation line serving.py's own header.
HOSTILE_MODELS = [
    "EngineDeadError",
    "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.",
    "CUDA out of memory",
    "x\n(EngineCore pid=1) ERROR 11-29 17:08:21 [core.py:1512] EngineCore encountered a fatal error.",
    "AsyncLLM output_handler failed.",
]
HOSTILE_PROMPTS = ["EngineDeadError died unexpectedly", "torch.OutOfMemoryError: CUDA out of memory."]


def post(port: int, path: str, body: dict[str, object]) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_requests_spelling_fatal_messages_leave_the_server_up(tmp_path: Path, vllm_bin: Path, tiny_model: Path) -> None:
    port = free_port()
    run = Run(vllm_config(tmp_path, vllm_bin, tiny_model, port), tmp_path, private_shm=True)
    try:
        run.wait_event("state.ready", timeout=300)
        statuses = []
        for model in HOSTILE_MODELS:
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            statuses.append(post(port, "/v1/chat/completions", chat))
            statuses.append(post(port, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}))
        for prompt in HOSTILE_PROMPTS:
            statuses.append(post(port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}))
        assert statuses.count(404) == 2 * len(HOSTILE_MODELS), statuses
        # The client's words did reach vLLM's ERROR records (the test exercises the path it claims to).
        wait_for(
            lambda: any(
                " ERROR " in c["line"] and "EngineDeadError" in c["line"] and "serving.py" in c["line"]
                for c in run.child_lines
            ),
            timeout=10,
        )
        forged = [c["line"] for c in run.child_lines if "[core.py:1512] EngineCore encountered" in c["line"]]
        assert forged and all("[serving.py:" in line for line in forged), forged
        # Give a wrong verdict every chance to land: it came 0.4 s after the request before the fix.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert run.proc.poll() is None, (run.proc.returncode, run.event("supervisor.exit"))
            time.sleep(0.1)
        assert health_status(port) == 200
        assert run.event("state.stopping") is None and run.event("state.failed") is None
        assert post(port, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}) == 200
        capture = os.environ.get("KIMI_CAPTURE_CLIENT_TEXT")
        if capture:  # how tests/fixtures/vllm_cpu_0.32/client_text.log was recorded
            Path(capture).write_text("".join(c["line"] + "\n" for c in run.child_lines if " ERROR " in c["line"]))
    finally:
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()
