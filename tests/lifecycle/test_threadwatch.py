"""docs/fault-matrix.md: a canary reply cannot kill the canary thread or outlast its deadline, and a check
thread that dies anyway ends the run (exit 70) instead of leaving its check off while the watchdog is pinged."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import EngineWedged, ExitCode, ThreadDied
from kimi_supervisor.lifecycle.threadwatch import ThreadWatch
from kimi_supervisor.liveness.engine import DeepLiveness, LivenessInputs, send_canary
from kimi_supervisor.liveness.http import Answer
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.lifecycle import FakeLiveness, SilentNotifier
from testkit.fakes.lifecycle_world import serving_world
from testkit.fakes.log import RecordingLog
from tests.rawserver import answer, raw_server

DEEP = b"[" * 100_000 + b"]" * 100_000


def test_a_100k_deep_canary_reply_is_a_counted_failure() -> None:
    # Was: json.loads raised RecursionError in the canary thread, which died; the canary was off for good.
    with raw_server(*answer("200 OK", DEEP)) as srv:
        result = send_canary(srv.url("/v1/completions"), "m", 2.0)
    assert not result.ok and result.error == "HTTP 200, JSON nested too deeply"


def test_a_canary_body_that_trickles_is_cut_at_the_canary_timeout() -> None:
    # Headers at once, then the body one byte per 0.3 s (~20 s in all): was held for the whole body.
    head, body = answer("200 OK", b'{"choices": [{"text": "x"}]}' + b" " * 40)
    with raw_server(head, body, body_byte_s=0.3) as srv:
        start = time.monotonic()
        result = send_canary(srv.url("/v1/completions"), "m", 1.0)
        took = time.monotonic() - start
    assert not result.ok and result.error == "no complete answer within 1s"
    assert took < len(body) * 0.3, took  # cut at the timeout: the whole body would need ~20 s


def _liveness_config(tmp_path: Path) -> Config:
    return parse_config(
        {
            "child": {"argv": ["vllm", "serve", "/models/m", "--port", "8000"]},
            "liveness": {"canary_interval_s": 0.05, "when": "always", "failures_tolerated": 3, "stuck_after_s": 0},
            "gpu_health": {"xid_events": False},
        },
        tmp_path / "k.toml",
    )


class _Client:
    """A fake HttpClient: every request gets `reply()`; `calls` counts them."""

    def __init__(self, reply: Answer | Exception) -> None:
        self.reply = reply
        self.calls = 0

    def __call__(self, method: str, url: str, timeout_s: float, **kw: object) -> Answer:
        self.calls += 1
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


def test_the_canary_thread_counts_deep_replies_until_the_streak_ends_the_run(tmp_path: Path) -> None:
    client = _Client(Answer(200, DEEP, None, 0.0, 0.0))
    woken = threading.Semaphore(0)
    given = LivenessInputs(
        _liveness_config(tmp_path), FakeGpuProbe([]), (), woken.release, SilentNotifier(), RecordingLog(), {},
        http=client,
    )  # fmt: skip
    deep = DeepLiveness(given)
    deep.start()
    try:
        with pytest.raises(EngineWedged) as info:
            for _ in range(3):
                assert woken.acquire(timeout=10), "no canary result within 10 s"
                deep.check()
    finally:
        deep.close()
    assert info.value.message == (
        "engine wedged: the 1-token canary completion failed 3 times in a row (HTTP 200, JSON nested too deeply)"
    )
    assert client.calls >= 3


def test_a_dead_canary_thread_is_recorded_for_the_loop(tmp_path: Path) -> None:
    # A bug in the canary's path (here: the client itself raising) kills the thread; the watch says so.
    watch = ThreadWatch()
    died = threading.Event()
    watch.install(died.set)
    given = LivenessInputs(
        _liveness_config(tmp_path), FakeGpuProbe([]), (), lambda: None, SilentNotifier(), RecordingLog(), {},
        http=_Client(RuntimeError("a bug")),
    )  # fmt: skip
    deep = DeepLiveness(given)
    try:
        deep.start()
        assert died.wait(10), "the canary thread's death was not recorded within 10 s"
    finally:
        deep.close()
        watch.uninstall()
    with pytest.raises(ThreadDied) as info:
        watch.check()
    assert info.value.exit_code == ExitCode.INTERNAL
    assert info.value.message == (
        "the canary thread died (RuntimeError: a bug): its check would be off for the rest of the run"
    )
    assert info.value.detail[0] == "Traceback (most recent call last):"
    assert info.value.detail[-1] == "RuntimeError: a bug"


def test_threads_not_ours_go_to_the_previous_hook() -> None:
    seen: list[str] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.thread.name if args.thread else "")
    watch = ThreadWatch()
    try:
        watch.install(lambda: None)
        t = threading.Thread(target=lambda: 1 / 0, name="someone-elses")
        t.start()
        t.join(10)
    finally:
        watch.uninstall()
        threading.excepthook = previous
    assert seen == ["someone-elses"] and watch.deaths == []
    watch.check()  # nothing of ours died: no raise


class _DyingLiveness(FakeLiveness):
    """Starts a check thread named like the canary that dies at once (joined: the death is recorded on return)."""

    def start(self) -> None:
        super().start()
        t = threading.Thread(target=self._boom, name="canary", daemon=True)
        t.start()
        t.join(10)

    @staticmethod
    def _boom() -> None:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")


def test_a_check_thread_that_dies_ends_the_run_with_70_and_stops_the_tree(tmp_path: Path) -> None:
    # Fake time, the real loop and the real ThreadWatch.  Was: the run went on serving (and pinging the
    # watchdog) with the canary silently off, until the SIGTERM at 30 s ended it with exit 0.
    w = serving_world(tmp_path, watchdog_s=10.0)
    w.liveness = _DyingLiveness()
    w.signal_at(30.0)
    assert w.run() == ExitCode.INTERNAL
    assert w.error is not None and w.error.message.startswith(
        "the canary thread died (RecursionError: maximum recursion depth exceeded while decoding a JSON array)"
    )
    assert w.child is not None and w.child.signals and w.child.signals[0][1].name == "SIGTERM"
    ready = w.notes.times("READY", 1)[0]
    assert w.child.signals[0][0] - ready < 0.5  # at the loop's first look, not at the 30 s SIGTERM
    assert all(t <= ready + 0.5 for t in w.notes.times("WATCHDOG", 1))
