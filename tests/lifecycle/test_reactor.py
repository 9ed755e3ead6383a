"""The reactor (kimi_supervisor/lifecycle/reactor.py): timers, readers, wake-ups, the stop answer, the
Clock view, and the child's exit through a pidfd (a real process) or, without one, a poll."""

from __future__ import annotations

import os
import selectors
import signal
import sys
import threading
import time

import pytest

from kimi_supervisor.child import process
from kimi_supervisor.child.process import ChildProcess
from kimi_supervisor.config.model import SpawnSpec
from kimi_supervisor.lifecycle.reactor import EXIT_POLL_S, Reactor
from kimi_supervisor.lifecycle.signals import SignalRecorder, StopRequested
from testkit.fakes.clock import FakeClock
from testkit.fakes.lifecycle import FakeSelector, FakeSignals
from testkit.fakes.log import RecordingLog


def fake_reactor() -> tuple[Reactor, FakeClock, FakeSignals, RecordingLog]:
    """A reactor on the fake clock, as the lifecycle tests run it."""
    clock, signals, log = FakeClock(), FakeSignals(), RecordingLog()
    return Reactor(signals, log, FakeSelector(clock), now=clock.monotonic), clock, signals, log


def test_timers_run_in_order_and_a_cancelled_one_never() -> None:
    reactor, clock, _, _ = fake_reactor()
    ran: list[tuple[str, float]] = []
    reactor.call_later(0.3, lambda: ran.append(("c", clock.t)))
    reactor.call_later(0.1, lambda: ran.append(("a", clock.t)))
    reactor.call_at(clock.now + 0.2, lambda: ran.append(("b", clock.t)))
    reactor.call_later(0.15, lambda: ran.append(("cancelled", clock.t))).cancel()
    while clock.t < 1.0:
        reactor.run_once(10.0)  # the nearest timer, not the 10 s, ends each wait
    assert [(name, round(t, 3)) for name, t in ran] == [("a", 0.1), ("b", 0.2), ("c", 0.3)]


def test_a_reader_runs_when_readable_and_not_once_removed() -> None:
    reactor, _, _, _ = fake_reactor()
    r, w = os.pipe()
    got: list[bytes] = []
    try:
        reactor.add_reader(r, lambda: got.append(os.read(r, 100)))
        os.write(w, b"x")
        assert reactor.run_once(5.0) == 1 and got == [b"x"]
        reactor.remove_reader(r)
        os.write(w, b"y")
        assert reactor.run_once(0.0) == 0 and got == [b"x"]
    finally:
        os.close(r)
        os.close(w)


def test_turn_hooks_run_after_every_turn_until_removed() -> None:
    reactor, _, _, _ = fake_reactor()
    turns: list[int] = []

    def hook() -> None:
        turns.append(1)

    reactor.add_turn_hook(hook)
    reactor.run_once(0.0)
    reactor.run_once(0.1)
    reactor.remove_turn_hook(hook)
    reactor.run_once(0.0)
    assert len(turns) == 2


def test_another_threads_wake_ends_the_wait() -> None:
    reactor = Reactor(SignalRecorder(), RecordingLog(), selectors.DefaultSelector())
    waker = threading.Thread(target=reactor.wake)
    start = time.monotonic()
    waker.start()
    assert reactor.run_once(30.0) == 1  # the signal pipe's handler: the wake, not the 30 s
    assert time.monotonic() - start < 30.0
    waker.join(5.0)


def test_the_steady_clock_sleeps_through_a_stop_signal() -> None:
    """The stop path's GPU confirmation (stopping.confirm_gpus_free) is not cut short by a second signal."""
    reactor, clock, signals, _ = fake_reactor()
    clock.at(1.0, lambda: signals.send(signal.SIGTERM))
    reactor.steady_clock.sleep(5.0)
    assert clock.t == pytest.approx(5.0)
    with pytest.raises(StopRequested):
        reactor.clock.sleep(5.0)
    assert clock.t == pytest.approx(5.0)  # raised before waiting: the stop was requested already


def test_the_interruptible_clock_ends_at_the_fake_instant_of_the_signal() -> None:
    reactor, clock, signals, _ = fake_reactor()
    clock.at(1.0, lambda: signals.send(signal.SIGTERM))
    with pytest.raises(StopRequested):
        reactor.clock.sleep(5.0)
    assert clock.t == pytest.approx(1.0)


def test_the_stop_answer_logs_each_new_signal_once() -> None:
    reactor, _, signals, log = fake_reactor()
    signals.send(signal.SIGHUP)
    assert reactor.stop_signalled("starting") is False
    signals.send(signal.SIGTERM)
    assert reactor.stop_signalled("starting") is True
    assert reactor.stop_signalled("starting") is False  # looked at already
    assert reactor.stop_signalled("waiting", sticky=True) is True  # unless sticky
    assert [e for _, e, _ in log.records] == ["signal.ignored", "signal.received"]


class PolledChild:
    """A child without a pidfd (pidfd_open refused): it exits at fake second `exits_at`."""

    pid = 4243
    exit_fd = None
    exit_fd_error = "pidfd_open: Operation not permitted"

    def __init__(self, clock: FakeClock, exits_at: float) -> None:
        self._clock, self._exits_at = clock, exits_at

    def poll(self) -> int | None:
        return 1 if self._clock.t >= self._exits_at else None


def test_without_a_pidfd_the_exit_is_polled_and_the_reason_logged_once() -> None:
    reactor, clock, _, log = fake_reactor()
    seen: list[float] = []
    reactor.watch_exit(PolledChild(clock, 0.35), lambda: seen.append(clock.t))
    reactor.watch_exit(PolledChild(clock, 0.35), lambda: None)  # a second child: no second warning
    while not seen:
        reactor.run_once(30.0)
    assert 0.35 <= seen[0] <= 0.35 + EXIT_POLL_S + 1e-9
    (warning,) = log.events("reactor.exit_polled")
    assert warning["why"] == "pidfd_open: Operation not permitted"


def _sleeper(seconds: float) -> ChildProcess:
    """A real child that prints nothing, sleeps, then exits 3."""
    code = f"import time; time.sleep({seconds}); raise SystemExit(3)"
    return ChildProcess.spawn(SpawnSpec((sys.executable, "-c", code), {}, True, None, None))


def test_a_real_childs_exit_wakes_the_turn_through_its_pidfd() -> None:
    """Nothing else can end this wait early: no output is read, no timer is set, nobody wakes it."""
    reactor = Reactor(SignalRecorder(), RecordingLog(), selectors.DefaultSelector())
    child = _sleeper(0.5)
    exited: list[float] = []
    try:
        reactor.watch_exit(child, lambda: exited.append(time.monotonic()))
        start = time.monotonic()
        ran = reactor.run_once(30.0)  # ONE turn
        returned = time.monotonic()
        assert exited, "the turn ended without the exit handler: the exit was not watched by a pidfd"
        assert ran == 1 and returned - exited[0] < 5.0 and returned - start < 30.0
        assert child.poll() == 3
    finally:
        if child.poll() is None:
            child.signal_tree(signal.SIGKILL)
        reactor.unwatch_exit(child)
        child.reap()
    assert child.exit_fd is None  # closed with the reap


def test_a_refused_pidfd_open_leaves_the_child_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(pid: int, flags: int = 0) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(process.os, "pidfd_open", refuse)
    child = _sleeper(0.0)
    try:
        assert child.exit_fd is None and child.exit_fd_error == "pidfd_open: Operation not permitted"
    finally:
        child.signal_tree(signal.SIGKILL)
        child._popen.wait(timeout=10)  # no pidfd to wait on here; reaped, not left a zombie for later tests
        child.reap()
