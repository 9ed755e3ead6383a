"""The lifecycle's logic on a fake clock: `Supervisor` in-process, every boundary faked (fakes/lifecycle_world.py).

Each test scripts vLLM's lines, /health answers and signals against fake time and runs in milliseconds.
Every way out of a run and every signal are in test_lifecycle_exits.py.  What only real processes prove
(process trees, pipes under load, the CLI, systemd) stays in test_supervisor.py, test_exits.py,
test_faults.py and the systemd tier.
"""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import pytest

from kimi_supervisor.states import State
from testkit.fakes.lifecycle_world import (
    FATAL,
    HEALTH_LINE,
    LOADING,
    STARTED,
    TICK,
    World,
    lifecycle_config,
    ready_times,
    serving_world,
)


def test_ready_only_after_the_started_line_even_when_health_answers_first(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path))
    w.say_at(0.1, LOADING)
    w.say_at(2.0, STARTED)
    w.health = lambda t: 200 if t >= 0.5 else None  # /health up long before the log says so
    w.signal_at(5.0)
    assert w.run() == 0
    [ready] = ready_times(w)
    assert 2.0 <= ready < 2.0 + TICK


def test_ready_only_after_a_200_even_when_the_log_said_started(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path))
    w.say_at(1.0, STARTED)
    w.health = lambda t: 200 if t >= 3.0 else 503
    w.signal_at(6.0)
    assert w.run() == 0
    [ready] = ready_times(w)
    assert 3.0 <= ready < 3.0 + TICK  # the burst after the started line, not the 0.1 s poll
    assert [e["error"] for e in w.events("health.not_yet")] == ["HTTP 503"]  # each new reason once
    assert w.supervisor.state.history[:3] == [State.PREFLIGHT, State.STARTING, State.READY]


def test_ready_once_through_failures_and_recovery(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.health = lambda t: 200 if 1.0 <= t < 5.0 or t >= 5.5 else 500  # two failed probes, then well again
    w.signal_at(10.0)
    assert w.run() == 0
    assert len(ready_times(w)) == 1
    assert [e["failures"] for e in w.events("health.failed")] == [1, 2]
    assert w.events("health.recovered") == [{"after_failures": 2}]
    assert w.notes.sent[-1][1] == {"STATUS": "stopped"}


def test_watchdog_pings_while_healthy_and_stop_after_health_failed(tmp_path: Path) -> None:
    # 10 tolerated failures (3 s) outlast the 2 s watchdog: only the failure streak can stop the pings.
    w = serving_world(tmp_path, watchdog_s=2.0, health={"failures_tolerated": 10})
    w.health = lambda t: 200 if 1.0 <= t < 10.0 else (None if t < 1.0 else 500)
    assert w.run() == 14
    pings = w.notes.times("WATCHDOG", 1)
    [ready] = ready_times(w)
    first_failure = w.log.when("health.failed")[0]
    assert pings and pings[0] >= ready
    assert max(b - a for a, b in itertools.pairwise([ready, *pings])) <= 1.0 + 0.01  # every wd/2, never late
    assert pings[-1] >= first_failure - 1.0 - 0.01  # pinged up to the failure...
    assert all(p < first_failure for p in pings)  # ...and never after it


def test_watchdog_not_pinged_while_liveness_is_failing(tmp_path: Path) -> None:
    w = serving_world(tmp_path, watchdog_s=2.0)

    def sick(flag: bool) -> None:
        w.liveness.healthy = not flag

    w.clock.at(4.0, lambda: sick(True))
    w.clock.at(8.0, lambda: sick(False))
    w.signal_at(12.0)
    assert w.run() == 0
    pings = w.notes.times("WATCHDOG", 1)
    assert not [p for p in pings if 4.0 < p < 8.0]
    assert [p for p in pings if 3.0 <= p <= 4.0] and [p for p in pings if 8.0 <= p <= 9.1]


def test_health_failures_exit_14_after_the_tolerated_number(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.health = lambda t: 200 if 1.0 <= t < 5.0 else (None if t < 1.0 else 500)
    assert w.run() == 14
    assert w.error is not None and w.error.message == "/health failed 3 times in a row (HTTP 500)"
    assert [e["failures"] for e in w.events("health.failed")] == [1, 2, 3]
    assert w.supervisor.state.history[-2:] == [State.STOPPING, State.FAILED]
    assert w.child is not None and [s for _, s in w.child.signals] == [signal.SIGTERM]


@pytest.mark.parametrize("status", [1, 0])  # 0 too: an exit nobody asked for is a failure whatever its status
def test_child_exit_after_ready_exits_13(tmp_path: Path, status: int) -> None:
    w = serving_world(tmp_path)
    w.clock.at(6.0, lambda: w.child.exit(status) if w.child else None)
    assert w.run() == 13
    assert w.error is not None
    assert w.error.message.startswith(f"vLLM exited with status {status} after it was ready (not requested)")
    assert w.supervisor.state.history[-2:] == [State.STOPPING, State.FAILED]
    assert 6.0 <= w.log.when("state.failed")[0] < 6.0 + TICK


@pytest.mark.parametrize(("exits_at", "code"), [(0.537, 11), (6.137, 13)], ids=["starting", "serving"])
def test_a_silent_crash_is_noticed_at_the_instant_of_the_exit(tmp_path: Path, exits_at: float, code: int) -> None:
    """The child's exit wakes the loop itself (its pidfd; the fake's stand-in pipe): no line, no end of file (a
    worker still holds the pipes), no probe result and no poll tick is needed.  Was: noticed at the next
    wake-up, up to a probe interval (0.1 s starting, 0.3 s serving here) or a watchdog half-period later."""
    w = serving_world(tmp_path, started_at=1.0)
    w.clock.at(exits_at, lambda: w.child.exit(1, pipes_held=True) if w.child else None)
    assert w.run() == code
    assert w.log.when("state.stopping")[0] == pytest.approx(exits_at, abs=1e-9)  # 0 ms of fake time later


def test_fatal_line_after_ready_exits_13_without_waiting_for_the_exit(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.say_at(6.0, FATAL)
    assert w.run() == 13
    assert w.error is not None
    assert w.error.message.startswith("vLLM reported a fatal error after it was ready: ")
    assert w.log.when("state.stopping")[0] < 6.0 + TICK


def test_fatal_line_while_starting_exits_11_quoting_it(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path))
    w.say_at(0.1, LOADING)
    w.say_at(3.0, FATAL)
    assert w.run() == 11
    assert w.error is not None
    assert w.error.message.startswith("vLLM failed while starting: ")
    assert "Worker proc VllmWorker-0 died unexpectedly" in w.error.message
    assert ready_times(w) == []
    assert w.log.when("state.stopping")[0] < 3.0 + TICK


def test_exit_while_starting_exits_11(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path))
    w.say_at(0.1, LOADING)
    w.clock.at(2.0, lambda: w.child.exit(1) if w.child else None)
    assert w.run() == 11
    assert w.error is not None and w.error.message.startswith("vLLM exited with status 1 before it was ready")


def test_silence_while_starting_is_a_stall_exit_12(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path, readiness={"stall_timeout_s": 30}))
    w.say_at(0.1, LOADING)
    assert w.run() == 12
    assert w.error is not None
    assert w.error.message.startswith("vLLM printed nothing for 30s (readiness.stall_timeout_s) while ")
    assert 30.1 <= w.log.when("state.stopping")[0] < 30.1 + 0.3  # one 0.25 s wait at most


def test_not_ready_by_the_deadline_exits_12(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path, readiness={"deadline_s": 60}))
    for i in range(100):
        w.say_at(0.1 + i, LOADING)  # never silent: only the deadline ends it
    assert w.run() == 12
    assert w.error is not None
    assert w.error.message.startswith("vLLM not ready after 60s (readiness.deadline_s)")
    assert w.error.message.endswith("(last /health: connection refused)")


def test_extend_timeout_while_starting(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path))
    for i in range(30):
        w.say_at(0.1 + i, LOADING)
    w.say_at(30.5, STARTED)
    w.health = lambda t: 200 if t >= 30.5 else None
    w.signal_at(32.0)
    assert w.run() == 0
    extends = w.notes.times("EXTEND_TIMEOUT_USEC")
    # One at the preflight, then at most every 5 s while output flows: systemd's start timeout never fires.
    assert len(extends) >= 7 and all(b - a >= 5.0 - 1e-9 for a, b in itertools.pairwise(extends[1:]))


def test_sigterm_while_ready_stops_cleanly_with_stopping(tmp_path: Path) -> None:
    w = serving_world(tmp_path)
    w.signal_at(5.0)
    assert w.run() == 0
    assert w.supervisor.state.history == [State.PREFLIGHT, State.STARTING, State.READY, State.STOPPING, State.STOPPED]
    names = w.names()
    # A stop requested while READY goes through the drain (no --shutdown-timeout here, 0 in flight: nothing to abort).
    stop = ["state.stopping", "stop.sigterm", "stop.main_exited", "stop.tree_gone", "stop.drain", "state.stopped"]
    assert names[names.index("state.stopping") :] == stop
    [stopping] = w.notes.times("STOPPING", 1)
    assert 5.0 <= stopping < 5.0 + 1.0  # the serving loop wakes on the signal pipe
    assert w.child is not None and w.child.main_signals == [(stopping, signal.SIGTERM)]
    # Was "aborted", which reads as lost requests: nothing was in flight.
    assert w.events("stop.drain")[0]["outcome"] == "nothing_in_flight"
    assert w.notes.sent[-1][1] == {"STATUS": "stopped"}


def test_sigterm_while_starting_stops_without_ready(tmp_path: Path) -> None:
    w = serving_world(tmp_path, started_at=20.0)
    w.signal_at(5.0)
    assert w.run() == 0
    assert ready_times(w) == []
    assert w.supervisor.state.history == [State.PREFLIGHT, State.STARTING, State.STOPPING, State.STOPPED]


def test_second_sigterm_shortens_the_grace(tmp_path: Path) -> None:
    w = serving_world(tmp_path, term_exit_after=None, shutdown={"grace_s": 20, "second_signal_grace_s": 0.5})
    w.signal_at(5.0)
    w.signal_at(6.0)
    assert w.run() == 0
    assert w.child is not None
    [(term_at, term), (kill_at, kill)] = w.child.signals
    assert (term_at, term, kill) == (5.0, signal.SIGTERM, signal.SIGKILL)
    assert 6.5 <= kill_at < 6.5 + TICK  # 0.5 s after the second signal, not 20 s after the first
    assert w.events("stop.hurry") and w.events("stop.sigkill")


@pytest.mark.parametrize("grace_s", [3.0, 7.5])
def test_sigkill_when_the_grace_runs_out(tmp_path: Path, grace_s: float) -> None:
    w = serving_world(tmp_path, term_exit_after=None, shutdown={"grace_s": grace_s})
    w.signal_at(5.0)
    assert w.run() == 0
    assert w.child is not None
    [(term_at, term), (kill_at, kill)] = w.child.signals
    assert (term, kill) == (signal.SIGTERM, signal.SIGKILL)
    assert term_at + grace_s <= kill_at < term_at + grace_s + TICK
    assert w.supervisor.state.history[-1] is State.STOPPED


def test_a_child_that_obeys_sigterm_is_not_killed(tmp_path: Path) -> None:
    w = serving_world(tmp_path, term_exit_after=1.0)
    w.signal_at(5.0)
    assert w.run() == 0
    assert w.child is not None and [s for _, s in w.child.signals] == [signal.SIGTERM]
    assert w.events("stop.sigkill") == []


def test_watchdog_pings_on_time_not_at_the_next_wake_up(tmp_path: Path) -> None:
    """The loop wakes for a due ping itself: probes every 0.45 s would make each one up to 0.45 s late."""
    w = serving_world(tmp_path, watchdog_s=2.0, health={"interval_s": 0.45, "timeout_s": 0.4})
    w.signal_at(12.0)
    assert w.run() == 0
    pings = w.notes.times("WATCHDOG", 1)
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert len(gaps) >= 9 and all(abs(g - 1.0) < 1e-6 for g in gaps), gaps


def test_the_headline_of_an_engine_on_its_uds_socket_shows_the_path_not_its_percent_encoding(tmp_path: Path) -> None:
    """An engine behind its front (docs/front.md) serves on vLLM's --uds: `unix:/run/.../engine.sock`, as the
    operator wrote it (was `http+unix://%2Frun%2F...`, the probes' URL)."""
    sock = tmp_path / "run" / "kimi" / "front" / "engine.sock"
    w = serving_world(tmp_path, child={"argv": ["vllm", "serve", "/models/m", "--uds", str(sock)]})
    w.signal_at(3.0)
    assert w.run() == 0
    [ready] = [fields for _, fields in w.notes.sent if fields.get("READY") == 1]
    assert str(ready["STATUS"]).startswith(f"ready: serving on unix:{sock} (started in ")


def test_a_crash_while_serving_quotes_the_lines_that_explain_it_not_the_health_probes(tmp_path: Path) -> None:
    """The failure's record (supervisor.detail, error priority) keeps the child's last lines that say something:
    requests answered below 400 (our own /health probes) are left out, a failed request is kept (was: 11 of the 15
    lines re-logged at error priority were `GET /health 200`)."""
    w = serving_world(tmp_path)
    t = 1.5
    w.say_at(t, "(EngineCore_DP0 pid=2) ERROR 11-29 17:08:21 [core.py:700] EngineCore hit an exception")
    for i in range(20):
        w.say_at(t + 0.01 * (i + 1), HEALTH_LINE)
    w.say_at(
        1.8, '(APIServer pid=1) INFO:     127.0.0.1:40001 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error'
    )
    w.say_at(1.9, "RuntimeError: CUDA error: an illegal memory access was encountered")
    w.clock.at(2.0, lambda: w.child.exit(1) if w.child else None)
    assert w.run() == 13
    assert w.error is not None
    assert w.error.detail[-3:] == [
        "(EngineCore_DP0 pid=2) ERROR 11-29 17:08:21 [core.py:700] EngineCore hit an exception",
        '(APIServer pid=1) INFO:     127.0.0.1:40001 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error',
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    assert not any('"GET /health HTTP/1.1" 200' in line for line in w.error.detail)
