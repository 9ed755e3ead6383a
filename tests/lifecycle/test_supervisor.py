"""The lifecycle against real processes: the CLI, the fake vLLM, a real notify socket."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from testkit.harness import HANG_S, Run, fake_config, fake_tree_of
from tests.conftest import wait_for


def test_ready_only_after_health_then_clean_stop(tmp_path: Path) -> None:
    # The gating logic runs in fake time in test_lifecycle.py; this is the CLI, real pipes, a real tree and socket.
    # The load holds after the first shard until the test has seen its STATUS: on a loaded machine the
    # whole load could otherwise pass inside one loop turn, and the loading STATUS coalesce away.
    release = tmp_path / "release-load"
    run = Run(
        fake_config(tmp_path, ["--load-seconds", "2", "--shards", "8", "--hold-load-until", str(release)]), tmp_path
    )
    try:
        loading = wait_for(
            lambda: any(f.get("STATUS", "").startswith("starting: loading weights ") for f in run.notify.fields()),
            timeout=60,
        )
        assert loading, [f.get("STATUS") for f in run.notify.fields()]
        assert run.notify.first("READY") is None  # held in the load: not serving, not ready
        release.touch()
        ready = run.wait_event("state.ready")
        assert ready["status"].startswith("ready: serving on http://127.0.0.1:")
        # The state.ready record and the READY=1 datagram travel apart (stderr, the notify socket): wait for it.
        ready_at = wait_for(lambda: run.notify.first("READY", "1"), timeout=10)
        fields = run.notify.fields()
        assert isinstance(ready_at, tuple) and ready_at[1]["STATUS"] == ready["status"]
        statuses = [f["STATUS"] for f in fields if "STATUS" in f]
        assert statuses[0] == "preflight: checking GPUs, stale processes and shared memory"
        assert statuses[1] == "starting: vLLM spawned"
        assert any(s.startswith("starting: loading weights ") for s in statuses), statuses
        assert sum(1 for f in fields if f.get("READY") == "1") == 1
        assert any("EXTEND_TIMEOUT_USEC" in f for f in fields)
        assert len(fake_tree_of(str(tmp_path))) == 4  # APIServer, EngineCore, 2 workers

        run.signal(signal.SIGTERM)
        assert run.wait() == 0
        # The server said it started.  Looked at once its stdout is read to the end: a forwarded child line and
        # the state.ready record travel apart (stdout, stderr), and CI once looked before the line was read.
        assert any("Application startup complete" in c["line"] for c in run.child_lines)
        names = run.names()
        # vLLM's main may exit a moment before its workers (stop.main_exited): order is all that is fixed.
        names = [n for n in names if n != "stop.main_exited"]
        assert names[names.index("state.stopping") :] == [
            "state.stopping",
            "stop.sigterm",
            "stop.tree_gone",
            "stop.drain",  # no --shutdown-timeout: outcome "aborted" or "nothing_in_flight" (the count at SIGTERM)
            "state.stopped",
        ]
        after = run.notify.fields()
        assert after[-3].get("STOPPING") == "1" and after[-1] == {"STATUS": "stopped"}
        assert after[-2] == {"STATUS": "stopping: tree gone"}
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


def test_crash_during_load_exits_11_quoting_the_root_cause(tmp_path: Path) -> None:
    run = Run(fake_config(tmp_path, ["--crash-during-load"]), tmp_path)
    rc = run.wait()
    assert rc == 11
    failed = run.event("state.failed")
    assert failed is not None
    exit_event = run.event("supervisor.exit")
    assert exit_event is not None and exit_event["kind"] == "StartupFailed"
    assert exit_event["error"].startswith('vLLM failed while starting: "(Worker_TP0 pid=')
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in exit_event["error"]
    assert run.notify.first("READY") is None
    assert fake_tree_of(str(tmp_path)) == []


def test_free_memory_error_quotes_vllms_message(tmp_path: Path) -> None:
    run = Run(fake_config(tmp_path, ["--free-memory-error"]), tmp_path)
    assert run.wait() == 11
    err = run.event("supervisor.exit")["error"]  # type: ignore[index]
    assert "ValueError: Free memory on device (12.34/139.81 GiB) on startup is less than desired GPU memory" in err


def test_silent_child_is_a_stall(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_silence_while_starting_is_a_stall_exit_12.  Here: the real tree goes.
    cfg = fake_config(tmp_path, ["--silent-load", "--load-seconds", "30"], readiness={"stall_timeout_s": 1.5})
    run = Run(cfg, tmp_path)
    assert run.wait() == 12
    assert "printed nothing for 1.5s" in run.event("supervisor.exit")["error"]  # type: ignore[index]
    assert fake_tree_of(str(tmp_path)) == []


def test_worker_death_after_ready_fails_fast_quoting_vllm(tmp_path: Path) -> None:
    # vLLM's main would exit by itself 60 s after the worker's death: an exit well before that is the supervisor's
    # own (by cause; how fast, on a busy machine, is not this test's to say: 4.2 s against 4 s with a tier beside).
    run = Run(fake_config(tmp_path, ["--kill-worker-after-ready", "0.5", "--engine-death-exit-delay", "60"]), tmp_path)
    run.wait_event("state.ready")
    assert run.wait(timeout=45) == 13
    # It did not wait for vLLM's own exit: it stopped vLLM's main, still alive, itself.
    sigterm = run.event("stop.sigterm")
    assert sigterm is not None and sigterm["processes"] >= 1, run.events
    err = run.event("supervisor.exit")["error"]  # type: ignore[index]
    assert err.startswith("vLLM reported a fatal error after it was ready: ")
    assert "died unexpectedly" in err
    assert fake_tree_of(str(tmp_path)) == []


def test_child_exit_after_ready_is_a_failure_even_with_status_0(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_child_exit_after_ready_exits_13 (status 0 and 1).  Here: a real
    # vLLM main that exits 0 (its workers killed) and the tree gone after.
    run = Run(fake_config(tmp_path, ["--exit-after-ready", "0.5", "--exit-code", "0"]), tmp_path)
    run.wait_event("state.ready")
    assert run.wait() == 13
    err = run.event("supervisor.exit")["error"]  # type: ignore[index]
    assert err.startswith("vLLM exited with status 0 after it was ready (not requested)")
    assert fake_tree_of(str(tmp_path)) == []


def test_unhealthy_after_ready_exits_14(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_health_failures_exit_14_after_the_tolerated_number.  Here: real 503s.
    run = Run(fake_config(tmp_path, ["--unhealthy-after", "0.5"]), tmp_path)
    run.wait_event("state.ready")
    assert run.wait() == 14
    assert run.event("supervisor.exit")["error"] == "/health failed 3 times in a row (HTTP 503)"  # type: ignore[index]
    assert len([e for e in run.events if e["event"] == "health.failed"]) == 3


def test_sigterm_ignored_escalates_to_sigkill_within_grace(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_sigkill_when_the_grace_runs_out.  Here: a real tree that ignores it.
    run = Run(fake_config(tmp_path, ["--ignore-sigterm"], shutdown={"grace_s": 1.0}), tmp_path)
    run.wait_event("state.ready")
    run.signal()
    # By cause: a tree that ignores SIGTERM never ends by itself, so only the SIGKILL at the grace ends it
    # inside this bound; how late past 1 s it lands on a busy machine is the fake-time test's to pin down.
    assert run.wait(timeout=60) == 0
    assert run.event("stop.sigkill") is not None
    assert fake_tree_of(str(tmp_path)) == []


@pytest.mark.parametrize("flag", ["--orphan-workers", "--worker-setsid"])
def test_orphaned_or_detached_workers_are_stopped_too(tmp_path: Path, flag: str) -> None:
    run = Run(fake_config(tmp_path, [flag]), tmp_path)
    run.wait_event("state.ready")
    run.signal()
    assert run.wait() == 0
    assert fake_tree_of(str(tmp_path)) == []


def test_sigterm_during_load_stops_cleanly(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle_exits::test_sigterm_ignored_while_loading_is_escalated_without_ready.
    # Here: a real tree still spawning its workers when the signal comes.
    # The load is held until a file that never comes: the signal lands during the load by cause, however long the
    # tree takes to appear (over 15 s beside a second suite), and the wait is only a hang's bound.
    fake_args = ["--load-seconds", "2", "--hold-load-until", str(tmp_path / "never"), "--ignore-sigterm-during-load"]
    run = Run(fake_config(tmp_path, fake_args, shutdown={"grace_s": 0.5}), tmp_path)
    wait_for(lambda: run.event("state.starting") and len(fake_tree_of(str(tmp_path))) >= 3, timeout=HANG_S)
    run.signal()
    assert run.wait() == 0
    assert run.notify.first("READY") is None
    assert fake_tree_of(str(tmp_path)) == []


def test_watchdog_pings_only_while_healthy(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_watchdog_pings_while_healthy_and_stop_after_health_failed.
    # Here: WATCHDOG_USEC from the environment and real datagrams from a really hung server.
    # The server hangs when the test has seen a ping after READY (a file, not a time: beside a second suite the
    # server's own "1 s after ready" once passed before the supervisor's READY, and no ping could come between).
    hang = tmp_path / "hang"
    run = Run(
        fake_config(
            tmp_path,
            ["--hang-when", str(hang)],
            health={"interval_s": 0.2, "timeout_s": 0.5, "failures_tolerated": 3},
        ),
        tmp_path,
        env={"WATCHDOG_USEC": "400000"},
    )
    ready = run.wait_event("state.ready")
    assert ready is not None
    wait_for(lambda: [d for at, d in run.notify.datagrams if d == "WATCHDOG=1"], timeout=HANG_S)
    hang.touch()
    assert run.wait() == 14
    pings = [at for at, d in run.notify.datagrams if d == "WATCHDOG=1"]
    ready_at = run.notify.first("READY", "1")
    # The causes: it pinged after READY, never before, and never once a probe failed (below).
    assert ready_at is not None and pings
    assert all(at > ready_at[0] for at in pings)  # never before READY
    assert any(e["event"] == "health.failed" for e in run.events)
    # Datagrams from one sender arrive in order: the health.failed STATUS= is a marker in the stream.
    sent = run.notify.messages()
    first_failing = next(i for i, d in enumerate(sent) if "/health failing" in d)
    assert "WATCHDOG=1" in sent[:first_failing]
    assert "WATCHDOG=1" not in sent[first_failing:], sent[first_failing:]  # pings stop once a probe fails


def test_abusive_output_does_not_hurt(tmp_path: Path) -> None:
    run = Run(fake_config(tmp_path, ["--long-line", "1048576", "--long-line-no-newline", "--invalid-utf8"]), tmp_path)
    run.wait_event("state.ready")
    cut = [c["line"] for c in run.child_lines if "[line cut:" in c["line"]]
    assert len(cut) == 1 and len(cut[0]) < 20_000
    assert any("\ufffd" in c["line"] for c in run.child_lines)
    run.signal()
    assert run.wait() == 0


def test_exact_notify_datagrams_in_order(tmp_path: Path) -> None:
    # The order of every kind of datagram is proven in fake time (test_lifecycle_exits::test_notify_datagrams_in_order).
    # Here: the bytes on a real socket, one datagram per send, READY's and the stop's exactly.
    run = Run(fake_config(tmp_path, ["--load-seconds", "1"]), tmp_path, env={"WATCHDOG_USEC": "1000000"})
    ready = run.wait_event("state.ready")
    wait_for(lambda: run.notify.first("WATCHDOG"))  # at least one watchdog ping, at WATCHDOG_USEC / 2
    run.signal()
    assert run.wait() == 0
    messages = run.notify.messages()
    assert messages[0] == "STATUS=preflight: checking GPUs, stale processes and shared memory"
    assert messages[1].startswith("EXTEND_TIMEOUT_USEC=") and messages[1].removeprefix("EXTEND_TIMEOUT_USEC=").isdigit()
    assert [m for m in messages if m.startswith("READY=")] == [f"READY=1\nSTATUS={ready['status']}"]
    assert "WATCHDOG=1" in messages[messages.index(f"READY=1\nSTATUS={ready['status']}") :]
    assert messages[-3:] == [
        "STOPPING=1\nSTATUS=stopping: stop requested",
        "STATUS=stopping: tree gone",
        "STATUS=stopped",
    ]
