"""The drain while stopping, against a fake server that drains (and whose worker dies on SIGTERM) like vLLM 0.32."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kimi_supervisor.config import parse_config
from kimi_supervisor.drain import SAMPLE_AT_SIGTERM_S, Drain
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.journal import ConsoleChildSink
from kimi_supervisor.proctable import PsutilProcessTable
from kimi_supervisor.state import State
from kimi_supervisor.supervisor import Deps, Supervisor
from tests.fakes.clock import RecordingLog
from tests.fakes.gpu import FakeGpu, FakeGpuProbe
from tests.fakes.lifecycle import SilentNotifier
from tests.harness import REPO, Run, fake_tree_of, free_port, write_config
from tests.sse_client import stream_completion

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DRAIN_FAKE = REPO / "tests" / "fakes" / "drain_vllm.py"


def drain_config(tmp_path: Path, port: int, shutdown_timeout: int | None, grace_s: float) -> Path:
    argv = [sys.executable, str(DRAIN_FAKE), "serve", "m", "--host", "127.0.0.1", "--port", str(port)]
    if shutdown_timeout is not None:
        argv += ["--shutdown-timeout", str(shutdown_timeout)]
    return write_config(
        tmp_path / "kimi.toml",
        {
            "child": {"argv": argv, "env": {"KIMI_TEST_MARKER": str(tmp_path)}},
            "preflight": {"gpus": [], "check_model": False, "check_port": True},
            "preflight.shm": {"directory": str(tmp_path)},
            "readiness": {"stall_timeout_s": 20, "deadline_s": 60, "poll_interval_s": 0.1},
            "health": {"interval_s": 0.5, "timeout_s": 1},
            "shutdown": {"grace_s": grace_s, "gpu_release_timeout_s": 0},
        },
    )


def stop_with_stream_in_flight(tmp_path: Path, shutdown_timeout: int | None, grace_s: float) -> tuple[Run, dict]:
    port = free_port()
    run = Run(drain_config(tmp_path, port, shutdown_timeout, grace_s), tmp_path)
    run.wait_event("state.ready", timeout=30)
    out: dict[str, Any] = {}
    body = {"model": "m", "prompt": "hi", "max_tokens": 60}  # 60 tokens x 50 ms: 3 s
    client = threading.Thread(target=stream_completion, args=(f"http://127.0.0.1:{port}/v1/completions", body, out, 60))
    client.start()
    deadline = time.monotonic() + 10
    while out.get("chunks", 0) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    out["chunks_at_sigterm"] = out["chunks"]
    run.signal()
    assert run.wait(timeout=grace_s + 10) == 0
    client.join(10)
    return run, out


def test_drain_lets_the_stream_finish_and_says_so(tmp_path: Path) -> None:
    run, out = stop_with_stream_in_flight(tmp_path, shutdown_timeout=10, grace_s=25)
    # The whole generation arrived: the worker was not SIGTERMed under the draining server.
    assert out["error"] is None and out["status"] == 200
    assert out["chunks"] == 60 and out["finish_reason"] == "length" and out["done"]
    statuses = [f["STATUS"] for f in run.notify.fields() if "STATUS" in f]
    assert any(s.startswith("stopping: draining 1 request in flight, ") and s.endswith(" of 10s") for s in statuses)
    assert statuses[-2:] == ["stopping: tree gone", "stopped"]
    logged = [e for e in run.events if e.get("event") == "stop.draining"]
    assert logged and logged[0]["status"].startswith("stopping: draining 1 request in flight")
    record = [e for e in run.events if e.get("event") == "stop.drain"]
    assert len(record) == 1
    assert record[0]["in_flight_at_sigterm"] == 1.0 and record[0]["outcome"] == "drained"
    assert 1.0 < record[0]["drain_s"] < 10  # ~2.7 s of tokens were left at SIGTERM
    assert record[0]["tree_gone"] is True
    assert run.event("stop.sigkill") is None
    assert fake_tree_of(str(tmp_path)) == []


def test_without_shutdown_timeout_the_stream_is_aborted_and_vllm_exits(tmp_path: Path) -> None:
    run, out = stop_with_stream_in_flight(tmp_path, shutdown_timeout=None, grace_s=5)
    # vLLM aborts the request (it cannot drain without --shutdown-timeout) and says so in the stream; had the
    # worker been SIGTERMed too, the stream would hang open and only SIGKILL at grace_s would end the server.
    assert out["error"] is None and out["finish_reason"] == "abort" and out["done"]
    assert out["chunks"] < 60
    assert run.event("stop.sigkill") is None
    record = [e for e in run.events if e.get("event") == "stop.drain"]
    assert len(record) == 1
    assert record[0]["in_flight_at_sigterm"] == 1.0 and record[0]["outcome"] == "aborted"
    assert fake_tree_of(str(tmp_path)) == []


def test_last_status_says_tree_gone_gpus_free(tmp_path: Path) -> None:
    """In process, with a GPU (the fake NVML probe): the stop ends on "stopping: tree gone, GPUs free"."""
    path = drain_config(tmp_path, free_port(), shutdown_timeout=10, grace_s=25)
    raw = tomllib.loads(path.read_text())
    raw["preflight"]["gpus"] = [0]
    raw["shutdown"]["gpu_release_timeout_s"] = 5
    cfg = parse_config(raw, path)
    sent: list[dict[str, str | int]] = []

    class Recording:
        def send(self, **fields: str | int) -> None:
            sent.append(fields)

    log = RecordingLog()
    sup = Supervisor(
        cfg,
        Deps(
            probe=FakeGpuProbe([FakeGpu()]),
            table=PsutilProcessTable(),
            notifier=Recording(),
            log=log,
            sink=ConsoleChildSink(open(os.devnull, "w")),  # noqa: SIM115
        ),
    )

    def stop_when_ready() -> None:
        deadline = time.monotonic() + 30
        while sup.state.state is not State.READY and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    assert sup.run() == ExitCode.OK
    statuses = [str(f["STATUS"]) for f in sent if "STATUS" in f]
    assert statuses[-2:] == ["stopping: tree gone, GPUs free", "stopped"]
    drains = [fields for _, event, fields in log.records if event == "stop.drain"]
    assert len(drains) == 1 and drains[0]["in_flight_at_sigterm"] == 0.0 and drains[0]["outcome"] == "drained"
    assert [e for _, e, _ in log.records if e == "stop.gpu_released"]


def test_a_hanging_metrics_endpoint_delays_sigterm_by_at_most_the_sample_bound() -> None:
    # /metrics accepts and never answers (an event loop saturated by a stream): the count is unknown, said so,
    # and vLLM still gets its SIGTERM once the one bounded read gives up.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    vllm = subprocess.Popen(["sleep", "60"])

    class Main:
        pid = vllm.pid

        def refresh_members(self) -> list[object]:
            return []

    log = RecordingLog()
    drain = Drain(f"http://127.0.0.1:{port}/health", 0, SilentNotifier(), log)
    try:
        t0 = time.monotonic()
        drain.sigterm(Main())  # type: ignore[arg-type]  # only pid and refresh_members are used
        waited = time.monotonic() - t0
        assert vllm.wait(timeout=5) == -signal.SIGTERM
        assert SAMPLE_AT_SIGTERM_S - 0.5 <= waited <= SAMPLE_AT_SIGTERM_S + 2, waited
        warning = log.events("stop.metrics_unavailable")
        assert len(warning) == 1 and warning[0]["url"] == f"http://127.0.0.1:{port}/metrics", log.records
        assert drain.in_flight_at_sigterm is None
    finally:
        vllm.kill()
        vllm.wait()
        listener.close()
