"""Every way out of a run, every signal and the notify stream, on a fake clock (testkit/fakes/lifecycle_world.py).

The real-process counterparts in test_exits.py and test_supervisor.py keep what only real processes prove: a
real pipe that breaks, real signals delivered to the CLI, a real tree killed, real datagrams on a socket,
cli.main's exit codes.  These prove the decisions: what is stopped first, which exit, which datagram when.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from kimi_supervisor.host.gpu import GpuMemory, GpuUnavailable
from kimi_supervisor.lifecycle.signals import STOP_SIGNALS
from kimi_supervisor.states import State
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle import RaisingSink
from testkit.fakes.lifecycle_world import (
    HEALTH_LINE,
    LOADING,
    TICK,
    World,
    lifecycle_config,
    ready_times,
    serving_world,
)

SERVED = [State.PREFLIGHT, State.STARTING, State.READY, State.STOPPING, State.STOPPED]

CAUSES = [
    KeyboardInterrupt(),
    SystemExit(3),
    BrokenPipeError(32, "Broken pipe"),
    psutil.AccessDenied(1, "x"),
    GpuUnavailable("GPU 0 memory: GPU is lost"),
    ZeroDivisionError("a bug"),
]


@pytest.mark.parametrize("exc", CAUSES, ids=lambda e: type(e).__name__)
def test_any_exception_stops_the_tree_before_it_goes_on(tmp_path: Path, exc: BaseException) -> None:
    w = serving_world(tmp_path, sink=RaisingSink(exc))
    for t in (2.0, 3.0, 4.0):  # the sink raises on the third /health access line
        w.say_at(t, HEALTH_LINE)
    with pytest.raises(type(exc)) as raised:
        w.run()
    assert raised.value is exc  # the same exception goes on to cli.main, after the stop
    assert w.child is not None
    [(term_at, term)] = w.child.signals
    assert term == signal.SIGTERM and 4.0 <= term_at < 4.0 + TICK  # at once, not at a later wake-up
    assert w.child.returncode == -signal.SIGTERM  # the tree was gone before the exception left run()
    names = w.names()
    stop = ["supervisor.emergency_stop", "state.stopping", "stop.sigterm", "stop.tree_gone"]
    final = "state.stopped" if isinstance(exc, BrokenPipeError) else "state.failed"  # the record (test_record_truth)
    assert names[names.index("supervisor.emergency_stop") :] == [*stop, final]
    assert str(w.events("supervisor.emergency_stop")[0]["error"]).startswith(type(exc).__name__)
    assert w.supervisor.state.history == [*SERVED[:4], State.STOPPED if final == "state.stopped" else State.FAILED]
    assert w.notes.times("STOPPING", 1) == [term_at]
    assert not w.signals.installed  # handlers given back
    assert w.liveness.closed


class LostGpu(FakeGpuProbe):
    memory_calls = 0

    def memory(self, index: int) -> GpuMemory:
        self.memory_calls += 1
        if self.memory_calls > 2:
            raise GpuUnavailable("GPU 0 memory: Unknown Error (the GPU fell off the bus)")
        return super().memory(index)


def test_gpu_lost_mid_preflight_spawns_nothing_and_goes_on(tmp_path: Path) -> None:
    # cli.main turns it into exit 10 (test_exits.py::test_gpu_lost_mid_preflight_exits_10_not_70).
    w = World(lifecycle_config(tmp_path, preflight={"gpus": [0]}), probe=LostGpu([FakeGpu()]))
    with pytest.raises(GpuUnavailable, match="Unknown Error"):
        w.run()
    assert w.child is None and w.prober is None
    assert w.supervisor.state.history == [State.PREFLIGHT, State.FAILED]  # recorded: test_record_truth.py
    assert w.events("supervisor.emergency_stop") == [] and w.events("preflight.passed") == []
    assert not w.signals.installed


def test_ignored_signals_neither_stop_nor_delay_a_run(tmp_path: Path) -> None:
    ignored = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGHUP, signal.SIGRTMIN]
    w = serving_world(tmp_path)
    w.signal_at(0.5, signal.SIGHUP)  # while starting
    for sig in ignored:  # while ready
        w.signal_at(3.0, sig)
    w.signal_at(6.0)
    assert w.run() == 0
    [ready] = ready_times(w)
    assert 1.0 <= ready < 1.0 + TICK
    events = w.events("signal.ignored")
    handled = sorted((t, str(e["signal"])) for t, e in zip(w.log.when("signal.ignored"), events, strict=True))
    assert handled == [(0.5, "SIGHUP"), *sorted((3.0, s.name) for s in ignored)]  # each when it arrives
    assert {e["why"] for e in events if e["signal"] == "SIGHUP"} == {"reload is not supported; restart the unit"}
    assert {e["why"] for e in events if e["signal"] != "SIGHUP"} == {"not a stop request"}
    assert w.supervisor.state.history == SERVED
    assert w.child is not None
    [(term_at, term)] = w.child.signals
    assert term == signal.SIGTERM and 6.0 <= term_at < 6.0 + TICK
    assert w.events("signal.received") == [{"signal": "SIGTERM", "state": "ready", "count": 1}]


@pytest.mark.parametrize("sig", sorted(STOP_SIGNALS), ids=lambda s: signal.Signals(s).name)
def test_every_stop_signal_stops_like_sigterm(tmp_path: Path, sig: signal.Signals) -> None:
    w = serving_world(tmp_path)
    w.signal_at(5.0, sig)
    assert w.run() == 0
    assert w.events("signal.received") == [{"signal": signal.Signals(sig).name, "state": "ready", "count": 1}]
    assert w.events("signal.ignored") == []
    assert w.supervisor.state.history == SERVED
    assert w.child is not None and [s for _, s in w.child.signals] == [signal.SIGTERM]
    assert w.notes.sent[-1][1] == {"STATUS": "stopped"}


def test_health_failures_before_ready_each_reason_once_and_the_last_named(tmp_path: Path) -> None:
    w = World(lifecycle_config(tmp_path, readiness={"deadline_s": 5}))
    w.say_at(0.1, LOADING)  # never says it started: a 200 alone is not ready
    w.health = lambda t: None if t < 1.0 else 503 if t < 2.0 else 200 if t < 2.5 else None
    assert w.run() == 12
    assert w.prober is not None and len(w.prober.probes) > 40  # every 0.1 s, logged only on a new reason
    not_yet = w.events("health.not_yet")
    assert [e["error"] for e in not_yet] == ["connection refused", "HTTP 503", "connection refused"]
    assert [e["phase"] for e in not_yet] == ["spawning", "loading weights", "loading weights"]
    assert w.error is not None and w.error.message.startswith("vLLM not ready after 5s (readiness.deadline_s)")
    assert w.error.message.endswith("(last /health: connection refused)")
    assert ready_times(w) == []
    assert w.child is not None and [s for _, s in w.child.signals] == [signal.SIGTERM]


def test_sigterm_ignored_while_loading_is_escalated_without_ready(tmp_path: Path) -> None:
    w = serving_world(tmp_path, started_at=20.0, term_exit_after=None, shutdown={"grace_s": 0.5})
    w.signal_at(5.0)
    assert w.run() == 0
    assert ready_times(w) == []
    assert w.child is not None
    [(term_at, term), (kill_at, kill)] = w.child.signals
    assert (term, kill) == (signal.SIGTERM, signal.SIGKILL)
    assert 5.0 <= term_at < 5.0 + TICK  # the starting loop wakes on the signal, not after its 0.25 s wait
    assert term_at + 0.5 <= kill_at < term_at + 0.5 + TICK
    assert w.supervisor.state.history == [State.PREFLIGHT, State.STARTING, State.STOPPING, State.STOPPED]
    assert w.notes.sent[-2:] == [(kill_at, {"STATUS": "stopping: tree gone"}), (kill_at, {"STATUS": "stopped"})]


def test_notify_datagrams_in_order(tmp_path: Path) -> None:
    w = serving_world(tmp_path, watchdog_s=1.0)
    w.signal_at(3.0)
    assert w.run() == 0

    def kind(fields: dict[str, str | int]) -> str:
        if list(fields) == ["STATUS"]:
            return "STATUS:" + str(fields["STATUS"]).split(":")[0].split(" ")[0]
        return "+".join(fields)

    kinds = [kind(f) for _, f in w.notes.sent]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed[:4] == ["STATUS:preflight", "EXTEND_TIMEOUT_USEC", "STATUS:starting", "EXTEND_TIMEOUT_USEC"]
    ready = collapsed.index("READY+STATUS")
    assert set(collapsed[4:ready]) <= {"STATUS:starting", "EXTEND_TIMEOUT_USEC"}
    assert collapsed[ready + 1 :] == ["WATCHDOG", "STOPPING+STATUS", "STATUS:stopping", "STATUS:stopped"]
    assert kinds.count("READY+STATUS") == 1
    assert [f for _, f in w.notes.sent[-3:]] == [
        {"STOPPING": 1, "STATUS": "stopping: stop requested"},
        {"STATUS": "stopping: tree gone"},
        {"STATUS": "stopped"},
    ]
    assert len(w.notes.times("WATCHDOG", 1)) == 4  # every 0.5 s from READY at 1.0 to the stop at 3.0
