"""Signals: handlers only record; the wake-up pipe ends waits early."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kimi_supervisor.signals import InterruptibleClock, SignalRecorder, StopRequested


def test_recorder_records_and_restores() -> None:
    before = signal.getsignal(signal.SIGHUP)
    rec = SignalRecorder()
    rec.install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert rec.new_signals() == [signal.SIGHUP]
        assert rec.new_signals() == []
        rec.wake()
        assert rec.new_signals() == []  # a wake-up is not a signal
    finally:
        rec.uninstall()
    assert signal.getsignal(signal.SIGHUP) == before


def test_interruptible_sleep_ends_on_sigterm() -> None:
    rec = SignalRecorder()
    rec.install()
    try:
        clock = InterruptibleClock(rec)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        with pytest.raises(StopRequested):
            clock.sleep(10)
        assert time.monotonic() - start < 2
        with pytest.raises(StopRequested):
            clock.sleep(10)  # the stop stays requested
    finally:
        rec.uninstall()
