"""Signals: handlers only record; the wake-up pipe ends the reactor's waits early (its clock's sleep here, the
rest in tests/lifecycle/test_reactor.py)."""

from __future__ import annotations

import gc
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

import kimi_supervisor
from kimi_supervisor.lifecycle.reactor import Reactor
from kimi_supervisor.lifecycle.signals import SignalRecorder, StopRequested
from testkit.fakes.log import RecordingLog

PACKAGE = os.path.dirname(kimi_supervisor.__file__) + os.sep


@pytest.fixture
def rec() -> Iterator[SignalRecorder]:
    """A recorder installed for the test and uninstalled after it."""
    recorder = SignalRecorder()
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.uninstall()


def test_recorder_records_and_restores() -> None:
    before = signal.getsignal(signal.SIGHUP)
    rec = SignalRecorder()
    rec.install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert rec.new_signals() == {signal.SIGHUP: 1}
        assert rec.new_signals() == {}
        rec.wake()
        assert rec.new_signals() == {}  # a wake-up is not a signal
    finally:
        rec.uninstall()
    assert signal.getsignal(signal.SIGHUP) == before


def test_interruptible_sleep_ends_on_sigterm(rec: SignalRecorder) -> None:
    reactor = Reactor(rec, RecordingLog(), selectors.DefaultSelector())
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    with pytest.raises(StopRequested):
        reactor.clock.sleep(60)
    assert time.monotonic() - start < 60  # the signal ended the sleep, not its 60 s
    with pytest.raises(StopRequested):
        reactor.clock.sleep(10)  # the stop stays requested


def test_recorder_does_not_grow_per_wake_up_or_signal(rec: SignalRecorder) -> None:
    """The prober wakes the loop once per probe (~17k a day): memory and each check stay O(1)."""
    for _ in range(20_000):
        rec.wake()
        rec.clear_wakeups()
    for _ in range(50):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert rec.new_signals() == {signal.SIGUSR1: 50}
    assert rec.counts == {signal.SIGUSR1: 50}  # one counter per signal number; wake-ups leave nothing


def _lines_run(fn: Callable[[], object]) -> int:
    """How many lines of the supervisor's code `fn` runs: the work done, counted, where a timing would be this
    machine's speed.  Only the supervisor's own frames, with the garbage collector off: a collection that a turn's
    allocation happens to trigger runs earlier tests' finalizers (a Popen's, a socket's) inside the turn (seen: 72
    lines for a turn of 63, once, beside a busy suite)."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        nonlocal lines
        if event == "call" and not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # not ours: no line events from this frame
        lines += event == "line"
        return trace

    gc.collect()
    gc.disable()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
        gc.enable()
    return lines


def test_interruptible_sleep_is_constant_time_per_wake_up(rec: SignalRecorder) -> None:
    """The old recorder kept every wake-up and each sleep scanned them: its work grew with the history."""
    reactor = Reactor(rec, RecordingLog(), selectors.DefaultSelector())

    def turn() -> None:
        rec.wake()
        reactor.clock.sleep(0.0)

    turn()
    fresh = [_lines_run(turn) for _ in range(3)]
    for _ in range(20_000):
        rec.wake()
    turn()  # takes the 20,000 pending wake-ups out of the pipe
    assert [_lines_run(turn) for _ in range(3)] == fresh
    assert fresh[0] > 0


def test_every_terminating_signal_is_a_stop_or_ignored(rec: SignalRecorder) -> None:
    """Catchable signals whose default would end the process: none is left at its default."""
    from kimi_supervisor.lifecycle.signals import IGNORED_SIGNALS, STOP_SIGNALS

    terminating = {
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGTERM,
        signal.SIGIO,
        signal.SIGPROF,
        signal.SIGVTALRM,
        signal.SIGXCPU,
        signal.SIGPWR,
        signal.SIGSTKFLT,
        *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
    }
    assert terminating <= STOP_SIGNALS | IGNORED_SIGNALS
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    for sig in terminating:
        assert signal.getsignal(sig) not in (signal.SIG_DFL, None), sig
