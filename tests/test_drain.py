"""The drain while stopping, against a fake server that drains (and whose worker dies on SIGTERM) like vLLM 0.32."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
TOKENS = 60  # 50 ms apart: the last one held until the test releases it


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
            # The supervisor's own /metrics sample (the liveness thread's) comes every 0.2 s: the stop waits for
            # one that has seen the stream running.
            "liveness": {"metrics_interval_s": 0.2},
            "shutdown": {"grace_s": grace_s, "gpu_release_timeout_s": 0},
        },
    )


def wait_until(what: str, predicate: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.01)


def child_said(run: Run, text: str) -> bool:
    return any(text in str(c.get("line", "")) for c in list(run.child_lines))


@dataclasses.dataclass
class Stop:
    run: Run
    out: dict[str, Any]  # what the client saw (tests/sse_client.py)
    chunks_at_stop: int  # the client's count when the stop was requested (the held last token not among them)
    released_after_sigterm_s: float | None  # the generation could end this long after SIGTERM was seen


def stop_with_stream_in_flight(tmp_path: Path, shutdown_timeout: int | None, grace_s: float) -> Stop:
    """A stream that cannot end before SIGTERM: its last token waits for a file the test writes only after the
    draining server got its SIGTERM (with a drain; without one it is never written: vLLM must abort it).  The
    stop is requested only once the client has chunks and the supervisor's own /metrics sample saw it running,
    so in flight at SIGTERM holds whatever the machine's speed and however long the supervisor takes to signal."""
    port = free_port()
    run = Run(drain_config(tmp_path, port, shutdown_timeout, grace_s), tmp_path)
    run.wait_event("state.ready", timeout=30)
    release = tmp_path / "release"
    out: dict[str, Any] = {}
    body = {"model": "m", "prompt": "hi", "max_tokens": TOKENS, "hold": str(release)}
    client = threading.Thread(target=stream_completion, args=(f"http://127.0.0.1:{port}/v1/completions", body, out, 60))
    client.start()
    try:
        wait_until("5 chunks at the client", lambda: out.get("chunks", 0) >= 5, 30)
        wait_until("the supervisor's sample sees it", lambda: child_said(run, "metrics: 1 in flight, read by kimi"), 30)
        chunks_at_stop = out["chunks"]
        run.signal()
        run.wait_event("stop.sigterm", timeout=30)  # logged once vLLM's main has its SIGTERM
        sigterm_seen = time.monotonic()
        released_after = None
        if shutdown_timeout:
            wait_until("vLLM draining", lambda: child_said(run, "stopping engine client mode=drain"), 30)
            release.touch()
            released_after = time.monotonic() - sigterm_seen
        assert run.wait(timeout=grace_s + 10) == 0
    finally:
        release.touch()  # never leave the client's thread behind
        client.join(30)
        run.kill()
    return Stop(run, out, chunks_at_stop, released_after)


def test_drain_lets_the_stream_finish_and_says_so(tmp_path: Path) -> None:
    stop = stop_with_stream_in_flight(tmp_path, shutdown_timeout=10, grace_s=25)
    run, out = stop.run, stop.out
    # In flight at SIGTERM: the last token was held until after it, and the supervisor counted one request.
    assert stop.chunks_at_stop < TOKENS
    record = [e for e in run.events if e.get("event") == "stop.drain"]
    assert len(record) == 1
    assert record[0]["in_flight_at_sigterm"] == 1.0, record
    # Drained: the whole generation arrived after SIGTERM (the worker was not SIGTERMed under the draining
    # server), and the supervisor waited for it.
    assert out["error"] is None and out["status"] == 200
    assert out["chunks"] == TOKENS and out["finish_reason"] == "length" and out["done"]
    assert record[0]["outcome"] == "drained" and record[0]["tree_gone"] is True
    assert stop.released_after_sigterm_s is not None
    assert stop.released_after_sigterm_s - 0.01 <= record[0]["drain_s"] < 10  # from SIGTERM to after the release
    statuses = [f["STATUS"] for f in run.notify.fields() if "STATUS" in f]
    assert any(s.startswith("stopping: draining 1 request in flight, ") and s.endswith(" of 10s") for s in statuses)
    assert statuses[-2:] == ["stopping: tree gone", "stopped"]
    logged = [e for e in run.events if e.get("event") == "stop.draining"]
    assert logged and logged[0]["status"].startswith("stopping: draining 1 request in flight")
    assert run.event("stop.sigkill") is None
    assert fake_tree_of(str(tmp_path)) == []


def test_without_shutdown_timeout_the_stream_is_aborted_and_vllm_exits(tmp_path: Path) -> None:
    stop = stop_with_stream_in_flight(tmp_path, shutdown_timeout=None, grace_s=5)
    run, out = stop.run, stop.out
    record = [e for e in run.events if e.get("event") == "stop.drain"]
    assert len(record) == 1
    # In flight at SIGTERM (held, never released), then aborted: vLLM cannot drain without --shutdown-timeout
    # and says so in the stream; had the worker been SIGTERMed too, the stream would hang open and only
    # SIGKILL at grace_s would end the server.
    assert stop.chunks_at_stop < TOKENS and record[0]["in_flight_at_sigterm"] == 1.0, record
    assert out["error"] is None and out["finish_reason"] == "abort" and out["done"]
    assert out["chunks"] <= TOKENS  # never the held last token: at most the others and the abort chunk
    assert record[0]["outcome"] == "aborted"
    assert run.event("stop.sigkill") is None
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
