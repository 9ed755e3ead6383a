"""Every way out of a run stops the tree first; signals are stop requests or ignored; SIGPIPE kills nothing.

Each cause is raised for real inside a running supervisor (in this process, around the real fake vLLM),
from the child-output sink the loop calls on every line: the same place a broken pipe, a bug or a psutil
error would surface.  The CLI-level rows run the real `kimi-supervisor` in a subprocess.  The decisions behind
each row (what is stopped first, which exit, which signal stops) are proven in fake time in
test_lifecycle_exits.py; these keep what takes a real process: real signals, pipes, sockets and trees.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.states import State
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.lifecycle import RaisingSink, SilentNotifier
from testkit.fakes.log import RecordingLog
from testkit.harness import HANG_S, REPO, Run, fake_config, fake_tree_of
from tests.conftest import wait_for

# The other four causes (SystemExit, psutil.AccessDenied, GpuUnavailable, a bug) take the same path, proven in
# fake time (test_lifecycle_exits.py::test_any_exception_stops_the_tree_before_it_goes_on, all six).  These two
# are the ones a real run meets for real: a reader that left (EPIPE) and Ctrl-C.
CAUSES = [KeyboardInterrupt(), BrokenPipeError(32, "Broken pipe")]


@pytest.mark.parametrize("exc", CAUSES, ids=lambda e: type(e).__name__)
def test_any_exception_stops_the_tree_first(tmp_path: Path, exc: BaseException) -> None:
    # Probes every 0.1 s: the third /health line comes soon after READY.
    cfg = load_config(fake_config(tmp_path, health={"interval_s": 0.1, "timeout_s": 1, "failures_tolerated": 3}))
    log = RecordingLog()
    sup = Supervisor(
        cfg,
        Deps(
            probe=FakeGpuProbe([]),
            table=PsutilProcessTable(),
            notifier=SilentNotifier(),
            log=log,
            sink=RaisingSink(exc),
        ),
    )
    try:
        with pytest.raises(type(exc)):
            sup.run()
        assert fake_tree_of(str(tmp_path)) == []
        assert log.events("supervisor.emergency_stop")[0]["error"].startswith(type(exc).__name__)  # type: ignore[union-attr]
        assert log.events("stop.tree_gone")
        assert State.STOPPING in sup.state.history
        assert signal.getsignal(signal.SIGTERM) is not sup.signals._record  # handlers given back
    finally:
        for p in fake_tree_of(str(tmp_path)):
            p.kill()


LOST_GPU = textwrap.dedent(
    """
    import sys
    from kimi_supervisor.cli import entry as cli
    from kimi_supervisor.host.gpu import GpuUnavailable
    from testkit.fakes.gpu import FakeGpu, FakeGpuProbe

    class LostGpu(FakeGpuProbe):
        def memory(self, index):
            self.memory_calls = getattr(self, "memory_calls", 0) + 1
            if self.memory_calls > 2:
                raise GpuUnavailable("GPU 0 memory: Unknown Error (the GPU fell off the bus)")
            return super().memory(index)

    cli.NvmlProbe = lambda: LostGpu([FakeGpu()])
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_gpu_lost_mid_preflight_exits_10_not_70(tmp_path: Path) -> None:
    cfg = fake_config(tmp_path, tp=1, preflight={"gpus": [0]})
    done = subprocess.run(
        [sys.executable, "-c", LOST_GPU, "--config", str(cfg), "--log-format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 10, done.stderr[-2000:]
    assert "GPU 0 memory: Unknown Error" in done.stderr and "Traceback" not in done.stderr


def test_ignored_signals_do_not_stop_a_ready_server(tmp_path: Path) -> None:
    run = Run(fake_config(tmp_path), tmp_path)
    try:
        run.wait_event("state.ready")
        ignored = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGHUP, signal.SIGPIPE, signal.SIGRTMIN]
        for sig in ignored:
            run.signal(sig)
        wait_for(lambda: len([e for e in run.events if e["event"] == "signal.ignored"]) >= len(ignored) - 1)
        time.sleep(0.5)
        assert run.proc.poll() is None and run.event("state.stopping") is None
        names = {e["signal"] for e in run.events if e["event"] == "signal.ignored"}
        assert names == {"SIGUSR1", "SIGUSR2", "SIGALRM", "SIGHUP", "SIGRTMIN"}  # SIGPIPE: SIG_IGN, silent
        assert len(fake_tree_of(str(tmp_path))) == 4
        run.signal(signal.SIGTERM)
        assert run.wait() == 0
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


# Every stop signal's logic, SIGQUIT and SIGPWR too: test_lifecycle_exits.py::test_every_stop_signal_stops_like_sigterm.
# Here SIGINT, delivered for real: Python's own handler for it would raise KeyboardInterrupt instead.
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: s.name)
def test_quit_and_int_are_stop_requests(tmp_path: Path, sig: signal.Signals) -> None:
    run = Run(fake_config(tmp_path), tmp_path)
    try:
        run.wait_event("state.ready")
        run.signal(sig)
        assert run.wait() == 0
        assert run.event("signal.received")["signal"] == sig.name  # type: ignore[index]
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


def test_hostile_request_path_does_not_restart_the_service(tmp_path: Path) -> None:
    """uvicorn logs `GET /EngineDeadError` as an INFO access line: a 404, not a fatal error (was exit 13)."""
    cfg = fake_config(tmp_path)
    run = Run(cfg, tmp_path)
    try:
        run.wait_event("state.ready")
        port = int(str(load_config(cfg).readiness.health_url).split(":")[2].split("/")[0])
        for path in ["/EngineDeadError", "/Worker%20proc%20died%20unexpectedly", "/CUDA%20out%20of%20memory"]:
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        wait_for(lambda: any("EngineDeadError" in c["line"] for c in run.child_lines))
        time.sleep(1.0)  # several loop iterations and health probes later
        assert run.proc.poll() is None and run.event("state.failed") is None
        run.signal()
        assert run.wait() == 0
    finally:
        run.kill()


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe `fd` reads from (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, bytes(4)), sys.byteorder, signed=True)


def test_stdout_nobody_reads_never_wedges_the_loop(tmp_path: Path) -> None:
    """stdout into a pipe nobody reads: READY, watchdog and SIGTERM go on; child lines are dropped and counted."""
    wd = 0.6
    # 20000 lines of 120 bytes: ten times what the pipe and the bounded buffer hold.
    cfg = fake_config(tmp_path, ["--flood-lines", "20000"], shutdown={"grace_s": 3})
    run = Run(cfg, tmp_path, env={"WATCHDOG_USEC": str(int(wd * 1e6))}, read_stdout=False)
    try:
        run.wait_event("state.ready", timeout=60)

        def ping_times() -> list[float]:
            return [at for at, d in run.notify.datagrams if d == "WATCHDOG=1"]

        # A wedged loop (the old bug) blocks in its write once the pipe is full and never pings again: so the
        # verdict is pings after the stall began, counted, not the size of the gaps between them (a busy machine's).
        # The stall began before READY, by quantity: the flood comes before READY and the meter lets >= 4000 of its
        # lines (~1 MB of JSON) through to stdout, past the pipe's 64 KiB and the writer's 256 KiB.  (Was: a wait for
        # fewer than 4096 bytes free in the pipe, which a pipe whose 16 pages are each partly filled never shows:
        # the kernel merges a write into the last page only when it fits whole; CI waited 60 s for it.)
        assert run.proc.stdout is not None
        pipe = run.proc.stdout.fileno()
        assert _unread(pipe) > 0
        stalled_at = len(ping_times())
        wait_for(lambda: len(ping_times()) >= stalled_at + 3, timeout=HANG_S)  # still nobody reads stdout
        assert run.event("child.dropped") is None  # no summary while the stall lasts
        run.read_stdout()  # the reader comes back: one summary
        dropped = run.wait_event("child.dropped", timeout=HANG_S)
        # > 1000: the flood's (a few access lines a second come after READY), so dropped before the pings above.
        assert int(dropped["lines"]) > 1000 and dropped["sink"] == "stdout"
        run.signal()
        # A wedged loop (the old bug) never exits: the bound only ends the wait for the event, at no machine speed.
        assert run.wait(timeout=60) == 0
        assert fake_tree_of(str(tmp_path)) == []
        assert len([e for e in run.events if e["event"] == "child.dropped"]) == 1
    finally:
        run.kill()


def test_broken_stdout_only_disables_that_sink(tmp_path: Path) -> None:
    """`kimi-supervisor | head`: the reader leaves; the server keeps being supervised (was: exit 0, orphaned)."""
    run = Run(fake_config(tmp_path), tmp_path, read_stdout=False)
    try:
        run.wait_event("state.ready")
        assert run.proc.stdout is not None
        run.proc.stdout.close()  # EPIPE on the next child line
        time.sleep(1.0)  # health access lines keep coming (every 0.3 s)
        assert run.proc.poll() is None and run.event("state.failed") is None
        assert len(fake_tree_of(str(tmp_path))) == 4
        run.signal()
        assert run.wait() == 0
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


def test_health_failures_before_ready_are_logged_and_named_at_the_deadline(tmp_path: Path) -> None:
    """Nothing answers the configured /health: each reason is logged once, and the exit names the last one.

    The deadline logic is also proven in fake time (test_lifecycle::test_not_ready_by_the_deadline_exits_12);
    this run adds the real prober's "connection refused" from a real closed port.
    """
    from testkit.harness import free_port

    url = f"http://127.0.0.1:{free_port()}/health"
    run = Run(fake_config(tmp_path, readiness={"health_url": url, "deadline_s": 1.5}), tmp_path)
    assert run.wait() == 12
    not_yet = [e for e in run.events if e["event"] == "health.not_yet"]
    assert [e["error"] for e in not_yet] == ["connection refused"]  # once, not every 0.1 s
    assert run.event("supervisor.exit")["error"].endswith("(last /health: connection refused)")  # type: ignore[index]
    assert fake_tree_of(str(tmp_path)) == []


def test_watchdog_pings_come_on_time_not_at_the_next_wake_up(tmp_path: Path) -> None:
    """WATCHDOG=1 comes from the loop's own timer, not at its next wake-up for a probe (it used to wait for one).

    The loop's timing is proven in fake time (test_lifecycle::test_watchdog_pings_on_time_not_at_the_next_wake_up,
    to the microsecond); this run is real datagrams from the real loop, judged by count, not by gaps (were `max(gaps)
    < wd`, this machine's speed; the lateness is bench row 8's): pings are due every wd/2 and probes come every
    0.8 wd, so on time the pings outrun the probes, one ahead every 1.3 wd or so, even on a busy machine (both
    late alike).  A loop that pinged only when a probe woke it sends at most one ping per probe: pings never outnumber
    the probes by 3 (a probe's access line seen late counts for one of them).  Probes every 0.8 wd: the pings'
    rule wants a pass within wd, so a probe may come 0.2 wd late without the pings stopping.
    """
    wd = 1.0
    cfg = fake_config(tmp_path, health={"interval_s": 0.8 * wd, "timeout_s": 0.4, "failures_tolerated": 3})
    run = Run(cfg, tmp_path, env={"WATCHDOG_USEC": str(int(wd * 1e6))})

    def pings() -> int:
        return sum(d == "WATCHDOG=1" for _, d in run.notify.datagrams)

    def probes() -> int:
        return sum("GET /health" in str(line.get("line", "")) for line in list(run.child_lines))

    try:
        run.wait_event("state.ready")
        pings0, probes0 = pings(), probes()
        # 60 s stops a hung test (about 3 s here alone); a loop that pings only at its probes never gets there.
        wait_for(lambda: pings() - pings0 >= probes() - probes0 + 3, timeout=60)
        run.signal()
        assert run.wait() == 0
    finally:
        run.kill()


def test_trickling_health_fails_the_probe_at_its_deadline(tmp_path: Path) -> None:
    """/health answering one byte every 0.5 s counts as a failure after timeout_s (it used to hang forever)."""
    cfg = fake_config(
        tmp_path, ["--trickle-health-after", "0.5"], health={"interval_s": 0.3, "timeout_s": 1, "failures_tolerated": 2}
    )
    run = Run(cfg, tmp_path)
    try:
        run.wait_event("state.ready")
        # The trickled answer would come whole, 200, after ~20 s a probe: only the deadline fails it (the errors
        # below say so), so the exit itself is the cause's; the wait's bound is no measure (was < 6 s).
        assert run.wait(timeout=120) == 14
        failed = [e for e in run.events if e["event"] == "health.failed"]
        assert [e["error"] for e in failed] == ["no answer within 1s", "no answer within 1s"]
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()
