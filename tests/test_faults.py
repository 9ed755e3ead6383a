"""Fault-matrix rows not covered by a module's own tests (see docs/fault-matrix.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import ExitCode, PreflightError
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.logs.journal import ConsoleChildSink
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.states import State
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle import SilentNotifier
from testkit.fakes.log import RecordingLog
from testkit.harness import Run, fake_config, free_port
from tests.conftest import ProcSpawner

ROOT = os.geteuid() == 0


def test_sigterm_during_preflight_wait_stops_at_once(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "child": {"argv": ["/bin/false", "serve", "/m", "--port", str(free_port())]},
            "preflight": {"gpus": [0], "deadline_s": 60, "check_model": False, "shm": {"directory": str(tmp_path)}},
            "paths": {"runtime_directory": str(tmp_path / "run"), "state_directory": str(tmp_path / "state")},
        },
        tmp_path / "k.toml",
    )
    probe = FakeGpuProbe([FakeGpu(hidden_used_mib=50_000)])  # busy, nobody to reap: it would wait 60 s
    log = RecordingLog()
    sup = Supervisor(
        cfg,
        Deps(
            probe=probe,
            table=PsutilProcessTable(),
            notifier=SilentNotifier(),
            log=log,
            sink=ConsoleChildSink(open(os.devnull, "w")),  # noqa: SIM115
        ),
    )
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    assert sup.run() == ExitCode.OK
    assert time.monotonic() - start < 60  # stopped by SIGTERM, not at the wait's 60 s deadline (was < 3 s)
    assert sup.state.history == [State.PREFLIGHT, State.STOPPING, State.STOPPED]
    assert sup.child is None


def test_sigterm_while_ready_and_second_sigterm_hurries(tmp_path: Path) -> None:
    # Also in fake time: test_lifecycle::test_second_sigterm_shortens_the_grace.  Here: real signals to the CLI.
    run = Run(
        fake_config(tmp_path, ["--ignore-sigterm"], shutdown={"grace_s": 900, "second_signal_grace_s": 0.5}), tmp_path
    )
    run.wait_event("state.ready")
    run.signal()
    run.wait_event("stop.sigterm")
    run.signal()
    # By cause, not by this machine's speed: without the hurry the stop would sit out a 15-minute grace,
    # far past this bound; with it the 0.5 s that is left ends in SIGKILL.
    assert run.wait(timeout=120) == 0
    assert run.event("stop.hurry") is not None and run.event("stop.sigkill") is not None


@pytest.mark.skipif(not ROOT, reason="mounting a read-only tmpfs needs root")
def test_read_only_shm_fails_the_preflight_naming_it(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "kimi-test", str(shm)], check=True)
    try:
        (shm / "psm_stale").write_bytes(b"x")
        subprocess.run(["mount", "-o", "remount,ro", str(shm)], check=True)
        cfg = parse_config(
            {
                "child": {"argv": ["vllm", "serve", "/m", "--port", str(free_port())]},
                "preflight": {"gpus": [], "check_model": False, "shm": {"directory": str(shm)}},
            },
            tmp_path / "k.toml",
        )
        with pytest.raises(PreflightError) as info:
            Preflight(cfg, FakeGpuProbe([]), PsutilProcessTable(), FakeClock(), RecordingLog()).run(dry_run=False)
        assert info.value.message == (
            f"preflight failed: shm: {shm} is not writable (read-only or no permission): "
            "NCCL and torch need it for their shared-memory segments"
        )
        assert (shm / "psm_stale").exists()
    finally:
        subprocess.run(["umount", str(shm)], check=True)


def test_another_users_processes_survive_every_path(tmp_path: Path, spawner: ProcSpawner) -> None:
    if not ROOT:
        pytest.skip("starting a process as another user needs root")
    # Owned by nobody and holding GPU contexts: one with "vllm" in an argument (someone's eval job),
    # one that even matches the kill rules by name. Neither may be signalled; both are named.
    evaluation = spawner.sleeper(extra_args=["eval.py", "--output-dir", "/data/vllm-eval"], uid=65534)
    lookalike = spawner.sleeper(title="VLLM::Worker_TP0", uid=65534)
    vllm_named = spawner.sleeper(title="VLLM::Worker_TP1")  # matches the rules but holds no GPU
    probe = FakeGpuProbe([FakeGpu(occupants={evaluation.pid: 20_000, lookalike.pid: 10_000})])
    cfg = parse_config(
        {
            "child": {"argv": ["vllm", "serve", "/m", "--port", str(free_port())]},
            "preflight": {"gpus": [0], "deadline_s": 2, "check_model": False, "shm": {"directory": str(tmp_path)}},
        },
        tmp_path / "k.toml",
    )
    log = RecordingLog()
    for dry in (True, False):
        if dry:
            report = Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=True)
            assert not report.proceed and not [c for c in report.checks if c.verdict.value == "would kill"]
            continue
        with pytest.raises(PreflightError) as info:
            Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=False)
        message = info.value.message
        assert f"PID {evaluation.pid} (python3) 20000 MiB: not killed, owned by user nobody" in message
        assert f"PID {lookalike.pid} (VLLM::Worker_TP) 10000 MiB: not killed, owned by user nobody" in message
        assert "not one of preflight.reap.users ['root']" in message
    assert log.events("preflight.kill") == []
    assert evaluation.poll() is None and lookalike.poll() is None and vllm_named.poll() is None


def test_supervisor_sigkilled_leaves_a_tree_the_next_preflight_names(tmp_path: Path) -> None:
    """Outside systemd nothing kills the orphaned tree; the next start refuses to double-start, naming it.

    Under systemd, KillMode=mixed kills the cgroup: see tests/nspawn (test_supervisor_sigkilled_*).
    """
    cfg = fake_config(tmp_path)
    run = Run(cfg, tmp_path)
    try:
        run.wait_event("state.ready")
        child = run.child_pid
        run.proc.kill()
        run.wait()
        (tmp_path / "second").mkdir()
        second = Run(cfg, tmp_path / "second")
        assert second.wait() == 10
        err = second.event("supervisor.exit")["error"]  # type: ignore[index]
        assert "is already in use by PID" in err
    finally:
        os.killpg(child, signal.SIGKILL)


def test_flooding_child_is_never_blocked_and_nothing_is_lost_silently(tmp_path: Path) -> None:
    """What a reader slower than the child could not take is dropped and counted, never lost silently."""
    run = Run(fake_config(tmp_path, ["--flood-lines", "200000"]), tmp_path)
    run.wait_event("state.ready", timeout=600)  # a hang's bound: beside a second suite the flood took over 60 s
    run.signal()
    assert run.wait() == 0
    flood = [int(c["line"].split("] flood line ")[1][:9]) for c in run.child_lines if "] flood line " in c["line"]]
    assert flood == sorted(set(flood))  # in order, no duplicates
    # Over the meter's budget (stdout is metered too): suppressed; past a stalled reader: dropped; both counted.
    counted = sum(int(e["lines"]) for e in run.events if e["event"] in ("child.dropped", "child.suppressed"))
    assert len(flood) <= 200000 <= len(flood) + counted
