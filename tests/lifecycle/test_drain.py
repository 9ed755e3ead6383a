"""The drain while stopping, against a fake server that drains (and whose worker dies on SIGTERM) like vLLM 0.32."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.drain import POLL_S, SAMPLE_AT_SIGTERM_S, Drain
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.logs.journal import ConsoleChildSink
from kimi_supervisor.states import State
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle import SilentNotifier
from testkit.fakes.lifecycle_world import TICK, World, serving_world
from testkit.fakes.log import RecordingLog
from testkit.harness import REPO, Run, fake_config, fake_tree_of, free_port, write_config
from testkit.sse_client import stream_completion
from tests.rawserver import answer, raw_server

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DRAIN_FAKE = REPO / "testkit" / "fakes" / "drain_vllm.py"
PAGE_ONE = b"vllm:num_requests_running 1.0\nvllm:num_requests_waiting 0.0\n"
HEAD_METRICS = answer("200 OK", PAGE_ONE, "text/plain")[0]
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
            "readiness": {"stall_timeout_s": 120, "deadline_s": 300, "poll_interval_s": 0.1},  # a hang's bounds
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
    out: dict[str, Any]  # what the client saw (testkit/sse_client.py)
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
    # From SIGTERM to after the release (the end, "drained" above, not the drain timeout: was also `< 10 s`).
    assert stop.released_after_sigterm_s - 0.01 <= record[0]["drain_s"]
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


def test_a_main_sigkilled_by_someone_else_while_draining_is_not_drained(tmp_path: Path) -> None:
    """The OOM killer (or an operator's kill -9) ends vLLM's main mid-drain with a request in flight: the record
    says `died` of SIGKILL, never `drained` (the supervisor sent only SIGTERM, so its own `killed` is not it)."""
    port = free_port()
    run = Run(drain_config(tmp_path, port, shutdown_timeout=10, grace_s=25), tmp_path)
    release = tmp_path / "release"  # never written before the kill: the request is in flight when the main dies
    out: dict[str, Any] = {}
    body = {"model": "m", "prompt": "hi", "max_tokens": TOKENS, "hold": str(release)}
    client = threading.Thread(target=stream_completion, args=(f"http://127.0.0.1:{port}/v1/completions", body, out, 60))
    try:
        run.wait_event("state.ready", timeout=30)
        client.start()
        wait_until("5 chunks at the client", lambda: out.get("chunks", 0) >= 5, 30)
        wait_until("the supervisor's sample sees it", lambda: child_said(run, "metrics: 1 in flight, read by kimi"), 30)
        run.signal()
        main_pid = run.wait_event("stop.sigterm", timeout=30)["pid"]
        wait_until("vLLM draining", lambda: child_said(run, "stopping engine client mode=drain"), 30)
        os.kill(main_pid, signal.SIGKILL)
        assert run.wait(timeout=35) == 0
    finally:
        release.touch()
        if client.ident is not None:
            client.join(30)
        run.kill()
    [record] = [e for e in run.events if e.get("event") == "stop.drain"]
    assert record["in_flight_at_sigterm"] == 1.0, record
    assert record["outcome"] == "died" and record["main_died_of"] == "SIGKILL", record
    assert run.event("stop.sigkill") is None  # the supervisor itself never sent SIGKILL
    statuses = [f["STATUS"] for f in run.notify.fields() if "STATUS" in f]
    assert "signal the supervisor did not send" in statuses[-2], statuses[-2:]
    assert fake_tree_of(str(tmp_path)) == []


def test_last_headline_says_tree_gone_gpus_free(tmp_path: Path) -> None:
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


class _Main:
    """vLLM's main as Drain.sigterm sees it: a real process of ours, no workers."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.pid = proc.pid
        self._proc = proc

    def poll(self) -> int | None:
        return self._proc.poll()

    def refresh_members(self) -> list[object]:
        return []

    def signal_main(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)


def test_metrics_trickling_its_status_line_cannot_delay_sigterm() -> None:
    # A status line and headers one byte per 0.9 s: each read is quick, the answer never whole.  The one read
    # before SIGTERM has an overall deadline: vLLM gets SIGTERM within SAMPLE_AT_SIGTERM_S (<= 0.5 s), the
    # count is unknown and said so (was: the stop held forever, until TimeoutStopSec's SIGKILL).
    vllm = subprocess.Popen(["sleep", "60"])
    log = RecordingLog()
    with raw_server(HEAD_METRICS, PAGE_ONE, head_byte_s=0.9) as srv:
        drain = Drain(srv.url("/health"), 0, SilentNotifier(), log)
        try:
            t0 = time.monotonic()
            drain.sigterm(_Main(vllm))  # type: ignore[arg-type]  # only pid and refresh_members are used
            assert vllm.wait(timeout=5) == -signal.SIGTERM
            signalled_within = time.monotonic() - t0  # an upper bound: the exit is seen after the signal
        finally:
            vllm.kill()
            vllm.wait()
    assert srv.connections == 1
    assert SAMPLE_AT_SIGTERM_S <= 0.5
    # Signalled at the read's deadline, not when the answer was whole (0.9 s a byte: `whole_s`): bounds by that
    # cause, not by this machine's speed (were 0.5 s and 1 s; the deadline itself is SAMPLE_AT_SIGTERM_S).
    whole_s = len(HEAD_METRICS) * 0.9
    assert drain.sigterm_after_s is not None and SAMPLE_AT_SIGTERM_S <= drain.sigterm_after_s < whole_s
    assert signalled_within < whole_s, signalled_within
    warning = log.events("stop.metrics_unavailable")
    assert len(warning) == 1, log.records
    assert warning[0]["url"] == srv.url("/metrics")
    assert warning[0]["error"] == f"GET /metrics: no answer within {SAMPLE_AT_SIGTERM_S:g}s"
    assert drain.in_flight_at_sigterm is None and drain.in_flight_source is None


def test_without_a_drain_the_count_comes_from_the_liveness_threads_latest_sample() -> None:
    # No drain, so no sampler after SIGTERM: when the read at SIGTERM cannot answer in time, the count is the
    # liveness thread's latest sample, taken before the stop (no read: it cannot delay the signal).
    vllm = subprocess.Popen(["sleep", "60"])
    log = RecordingLog()
    with raw_server(HEAD_METRICS, PAGE_ONE, head_byte_s=0.9) as srv:
        drain = Drain(srv.url("/health"), 0, SilentNotifier(), log)
        drain.liveness_sample = (time.monotonic() - 3.0, 2.0)
        try:
            drain.sigterm(_Main(vllm))  # type: ignore[arg-type]
            assert vllm.wait(timeout=5) == -signal.SIGTERM
            drain.finish(tree_gone=True)
        finally:
            vllm.kill()
            vllm.wait()
    (record,) = log.events("stop.drain")
    assert record["in_flight_at_sigterm"] == 2.0 and record["outcome"] == "aborted"
    assert str(record["in_flight_source"]).startswith("liveness sample 3.")
    # The read's deadline ended it (its warning), long before the answer could be whole: a bound by cause (was
    # <= 0.5 s against the 0.25 s deadline, this machine's speed).
    assert (
        log.events("stop.metrics_unavailable")[0]["error"] == f"GET /metrics: no answer within {SAMPLE_AT_SIGTERM_S:g}s"
    )
    after = record["sigterm_after_s"]
    assert isinstance(after, float) and SAMPLE_AT_SIGTERM_S <= after < len(HEAD_METRICS) * 0.9, after


def test_a_second_sigterm_during_a_stop_with_trickling_metrics_is_acted_on(tmp_path: Path) -> None:
    """In process, the real lifecycle and signals: vLLM ignores SIGTERM, /metrics trickles; the first SIGTERM
    reaches vLLM at once and the second cuts the 20 s grace to `second_signal_grace_s`."""
    cfg_path = fake_config(tmp_path, ["--ignore-sigterm"], tp=1)
    raw = tomllib.loads(cfg_path.read_text())
    raw["shutdown"].update({"grace_s": 20, "second_signal_grace_s": 0.5})
    cfg = parse_config(raw, cfg_path)
    log = RecordingLog()
    signalled: list[float] = []
    sigterm_before_second: list[bool] = []
    with raw_server(HEAD_METRICS, PAGE_ONE, head_byte_s=0.9) as srv:
        sup = Supervisor(
            cfg,
            Deps(
                probe=FakeGpuProbe([]),
                table=PsutilProcessTable(),
                notifier=SilentNotifier(),
                log=log,
                sink=ConsoleChildSink(open(os.devnull, "w")),  # noqa: SIM115
                # The real Drain, whose /metrics is the trickling server.
                drain=lambda url, timeout, notifier, lg, **io: Drain(srv.url("/health"), timeout, notifier, lg, **io),
            ),
        )

        def stop_twice() -> None:
            deadline = time.monotonic() + 30
            while sup.state.state is not State.READY and time.monotonic() < deadline:
                time.sleep(0.02)
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60  # stops a hung test: the stop loop runs once vLLM has its SIGTERM
            while not log.events("stop.sigterm") and time.monotonic() < deadline:
                time.sleep(0.02)
            sigterm_before_second.append(bool(log.events("stop.sigterm")))
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

        helper = threading.Thread(target=stop_twice, daemon=True)
        helper.start()
        assert sup.run() == ExitCode.OK
        helper.join(5)
    assert len(signalled) == 2
    # By cause, not by seconds (were < 2 s to stop.sigterm, < 5.5 s to the end and <= 0.5 s to the signal: this
    # machine's speed): vLLM had its SIGTERM before the second signal (was: never, while /metrics trickled), and the
    # SIGKILL followed the hurry the second signal asked for, not the 20 s grace (the helper's 60 s stops a hung test).
    assert sigterm_before_second == [True]
    events = [r[1] for r in log.records]
    assert "stop.hurry" in events and "stop.sigkill" in events
    assert events.index("stop.hurry") < events.index("stop.sigkill")
    (record,) = log.events("stop.drain")
    after = record["sigterm_after_s"]
    assert record["outcome"] == "killed" and isinstance(after, float)
    assert SAMPLE_AT_SIGTERM_S <= after < len(HEAD_METRICS) * 0.9, after
    assert fake_tree_of(str(tmp_path)) == []


def test_infinite_or_nan_in_flight_is_a_failed_sample_not_a_crash() -> None:
    # `vllm:num_requests_running +Inf`: was int(inf) in the stop's STATUS= text, OverflowError, the fallback
    # SIGTERM to the whole group (the drain cut), exit 70.
    vllm = subprocess.Popen(["sleep", "60"])
    log = RecordingLog()
    sent: list[dict[str, str | int]] = []

    class Notes:
        def send(self, **fields: str | int) -> None:
            sent.append(fields)

    page = b"vllm:num_requests_running +Inf\nvllm:num_requests_waiting NaN\n"
    with raw_server(*answer("200 OK", page, "text/plain")) as srv:
        drain = Drain(srv.url("/health"), 10, Notes(), log)
        try:
            drain.sigterm(_Main(vllm))  # type: ignore[arg-type]
            assert vllm.wait(timeout=5) == -signal.SIGTERM
            drain.tick(_Exited(vllm))  # type: ignore[arg-type]
            drain.finish(tree_gone=True)
        finally:
            vllm.kill()
            vllm.wait()
    warning = log.events("stop.metrics_unavailable")
    assert len(warning) == 1
    assert warning[0]["error"] == "unparseable /metrics: vllm:num_requests_running is inf: not a count"
    assert drain.in_flight_at_sigterm is None
    assert str(sent[0]["STATUS"]).startswith("stopping: draining requests in flight (count unknown), 0s of 10s")
    (record,) = log.events("stop.drain")
    assert record["outcome"] == "drained" and record["in_flight_at_sigterm"] is None


class _Exited(_Main):
    """vLLM's main once it has exited on its SIGTERM."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(proc)
        self.returncode = proc.returncode

    def poll(self) -> int | None:
        return self.returncode

    def signal_tree(self, sig: signal.Signals) -> int:
        return 0


# -- in fake time: the real Drain inside the lifecycle world (testkit/fakes/lifecycle_world.py) -----------------
# The commonest production stop: SIGTERM to a READY vLLM with a request in flight.  /metrics is the world's
# scripted client, the drain's sampler runs on the fake clock, the SIGTERM reaches the fake vLLM's main alone.

DRAINING_ARGV = ["vllm", "serve", "/models/m", "--port", "8000", "--shutdown-timeout", "10"]


def draining_world(tmp_path: Path, **kw: Any) -> World:
    w = serving_world(tmp_path, term_exit_after=None, child={"argv": DRAINING_ARGV}, **kw)
    w.signal_at(5.0)
    return w


def statuses(w: World) -> list[str]:
    return [str(f["STATUS"]) for _, f in w.notes.sent if "STATUS" in f]


def test_sigterm_to_a_ready_server_waits_for_the_request_in_flight_then_says_drained(tmp_path: Path) -> None:
    w = draining_world(tmp_path, shutdown={"grace_s": 30})
    w.in_flight = lambda t: 1.0 if t < 8.0 else 0.0  # the request finishes 3 s after the stop
    w.clock.at(8.4, lambda: w.child.exit(0) if w.child else None)  # then vLLM stops its engine and exits
    assert w.run() == 0
    [stopping] = w.notes.times("STOPPING", 1)
    assert 5.0 <= stopping < 5.0 + 1.0
    assert w.child is not None and w.child.main_signals == [(stopping, signal.SIGTERM)]  # the main alone
    assert w.child.signals == [(stopping, signal.SIGTERM)]  # nothing else: no SIGKILL, no tree-wide SIGTERM
    # The count at SIGTERM is the one read within SAMPLE_AT_SIGTERM_S, from the injected client.
    assert w.http.requests[0] == (stopping, "http://127.0.0.1:8000/metrics", SAMPLE_AT_SIGTERM_S)
    # Then the sampler, every POLL_S of fake time from SIGTERM on, until 0 at the fourth reading.
    assert w.drain_sampler is not None
    assert w.drain_sampler.readings[:4] == pytest.approx([stopping + i * POLL_S for i in range(4)])
    (record,) = w.events("stop.drain")
    assert record["in_flight_at_sigterm"] == 1.0 and record["in_flight_source"] == "read at SIGTERM"
    assert record["outcome"] == "drained" and record["tree_gone"] is True
    assert record["drain_s"] == pytest.approx(3 * POLL_S)  # the reading that saw 0
    assert record["drain_timeout_s"] == 10 and record["sigterm_after_s"] == 0.0
    assert w.events("stop.main_exited")[0]["after_s"] == pytest.approx(8.4 - stopping, abs=TICK)
    assert w.events("stop.sigkill") == []
    said = statuses(w)
    assert "stopping: draining 1 request in flight, 0s of 10s" in said
    assert "stopping: draining 1 request in flight, 2s of 10s" in said
    assert "stopping: drained in 3s, vLLM stopping its workers, 3s of 10s" in said
    assert said[-2:] == ["stopping: tree gone", "stopped"]
    assert w.events("stop.draining")[0]["in_flight"] == 1.0


def test_a_request_that_never_ends_is_cut_at_vllms_shutdown_timeout(tmp_path: Path) -> None:
    # In flight stays 1: vLLM's own --shutdown-timeout (10 s) ends the drain, it cuts the request and exits.
    w = draining_world(tmp_path, shutdown={"grace_s": 30})
    w.in_flight = lambda t: 1.0
    w.clock.at(15.5, lambda: w.child.exit(0) if w.child else None)
    assert w.run() == 0
    [stopping] = w.notes.times("STOPPING", 1)
    (record,) = w.events("stop.drain")
    assert record["in_flight_at_sigterm"] == 1.0
    assert record["outcome"] == "cut" and record["tree_gone"] is True
    assert 10 < record["drain_s"] == pytest.approx(15.5 - stopping, abs=TICK)
    assert w.events("stop.sigkill") == []
    said = statuses(w)
    assert "stopping: draining 1 request in flight, 10s of 10s" in said
    assert not any(s.startswith("stopping: drained in") for s in said[:-3])  # never 0 in flight
    assert said[-2:] == ["stopping: tree gone", "stopped"]


def test_a_drain_past_the_grace_is_sigkilled_and_the_record_says_killed(tmp_path: Path) -> None:
    # A wedged vLLM never exits and in flight stays 1: the supervisor's grace (the least the preflight allows
    # for a 10 s drain) ends it with SIGKILL.
    w = draining_world(tmp_path, shutdown={"grace_s": 25})
    w.in_flight = lambda t: 1.0
    assert w.run() == 0
    [stopping] = w.notes.times("STOPPING", 1)
    assert w.child is not None
    [kill_at] = [t for t, s in w.child.signals if s == signal.SIGKILL]
    assert 25.0 <= kill_at - stopping <= 25.0 + TICK
    (record,) = w.events("stop.drain")
    assert record["outcome"] == "killed" and record["in_flight_at_sigkill"] == 1.0
    assert record["drain_s"] == pytest.approx(kill_at - stopping)
    said = statuses(w)
    assert "stopping: SIGKILL to vLLM after 25s of draining (1 request in flight)" in said
    assert said[-2:] == ["stopping: tree gone (drain cut: vLLM was SIGKILLed, see stop.drain)", "stopped"]
