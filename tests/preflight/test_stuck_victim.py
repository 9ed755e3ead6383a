"""A reap victim that outlives SIGKILL in D state: the preflight says the GPU needs a reset and exits 22 at once,
instead of waiting preflight.deadline_s out (it would never free).  Real stale processes; the table withholds
the stuck one's signals and reads its /proc from real-format files (tests/host/test_procstate.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from kimi_supervisor.exitcodes import ExitCode, GpuNeedsReset, PreflightError
from kimi_supervisor.host.procstate import ProcState, read_state
from kimi_supervisor.host.proctable import ProcInfo, PsutilProcessTable
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from tests.conftest import ProcSpawner, wait_for
from tests.host.test_procstate import UVM_STACK, fake_proc
from tests.preflight.test_preflight import make_cfg


class StuckTable(PsutilProcessTable):
    """The real table, but `stuck`'s signals never land and its kernel state comes from `proc_files`.  Every other
    victim is killable, and dies within the preflight's SIGKILL wait: that wait runs on the fake clock, so the
    table gives a SIGKILLed victim the real time it takes to go (issue 39: beside a second suite one was still
    freeing its memory, in D state, when the fake 5 s had passed)."""

    def __init__(self, stuck: int, proc_files: Path) -> None:
        super().__init__()
        self.stuck = stuck
        self.proc_files = proc_files

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool:
        if proc.pid == self.stuck:
            return self.alive(proc)  # delivered, as to a process in D state: pending, never acted on
        delivered = super().signal(proc, sig)
        if delivered and sig == signal.SIGKILL:
            wait_for(lambda: not self.alive(proc), timeout=60, interval=0.01)
        return delivered

    def state(self, pid: int) -> ProcState | None:
        return read_state(pid, str(self.proc_files)) if pid == self.stuck else super().state(pid)


@pytest.mark.parametrize("state", ["D (disk sleep)", "S (sleeping)"])
def test_a_victim_stuck_in_d_state_fails_the_preflight_with_22_at_once(
    tmp_path: Path, spawner: ProcSpawner, state: str
) -> None:
    stuck = spawner.sleeper(title="VLLM::EngineCore")
    other = spawner.sleeper(title="VLLM::Worker_TP1")
    fake_proc(tmp_path / "proc", stuck.pid, state, "uvm_spin_loop", UVM_STACK)
    probe = FakeGpuProbe([FakeGpu(), FakeGpu(occupants={stuck.pid: 70000}), FakeGpu(occupants={other.pid: 500})])
    clock, log = FakeClock(), RecordingLog()
    cfg = make_cfg(tmp_path, gpus=[0, 1, 2])
    pf = Preflight(cfg, probe, StuckTable(stuck.pid, tmp_path / "proc"), clock, log)
    if state.startswith("S"):
        # Not in D state: it may still go (another namespace, a refused signal); the deadline is waited out.
        with pytest.raises(PreflightError, match=r"gpu_wait: GPUs still busy after 20\.0s"):
            pf.run(dry_run=False)
        return
    with pytest.raises(GpuNeedsReset) as info:
        pf.run(dry_run=False)
    assert info.value.exit_code == ExitCode.GPU_NEEDS_RESET
    assert info.value.message.startswith(
        "preflight: GPU 1 needs a reset or the host a reboot: 1 stale process(es) on them outlived SIGKILL by 5s "
        f"in the NVIDIA driver: PID {stuck.pid} (VLLM::EngineCor), state D (disk sleep), waiting in uvm_spin_loop"
    )
    assert clock.t < cfg.preflight.deadline_s  # grace 1 s + SIGKILL wait 5 s, not the 20 s deadline
    assert other.wait(5) is not None  # the rest of the reap happened
    assert log.events("preflight.unkillable")[0]["pid"] == stuck.pid


class GoneWhenReadTable(StuckTable):
    """The stuck victim finally goes while its /proc is read, and what was read (D state) is a newcomer's that
    got its PID: in a container's small PID namespace the next process can get it at once."""

    def __init__(self, stuck: subprocess.Popen[bytes], proc_files: Path) -> None:
        super().__init__(stuck.pid, proc_files)
        self.victim = stuck

    def state(self, pid: int) -> ProcState | None:
        read = super().state(pid)
        if pid == self.stuck and self.victim.poll() is None:
            self.victim.kill()
            self.victim.wait()
        return read


def test_a_d_state_read_from_a_newcomer_on_the_victims_pid_is_not_a_stuck_victim(
    tmp_path: Path, spawner: ProcSpawner
) -> None:
    """Exit 22 is not restarted on, so the stuck process must be the victim itself: a state read after the victim
    went and a newcomer took its PID says nothing of the victim (was: exit 22, "GPU 1 needs a reset"). The
    victim did outlive the reap's wait, so the preflight still fails, with 10, which systemd restarts."""
    stuck = spawner.sleeper(title="VLLM::EngineCore")
    fake_proc(tmp_path / "proc", stuck.pid, "D (disk sleep)", "uvm_spin_loop", UVM_STACK)
    probe = FakeGpuProbe([FakeGpu(), FakeGpu(occupants={stuck.pid: 70000})])
    clock, log = FakeClock(), RecordingLog()
    cfg = make_cfg(tmp_path, gpus=[0, 1])
    table = GoneWhenReadTable(stuck, tmp_path / "proc")
    pf = Preflight(cfg, probe, table, clock, log)
    with pytest.raises(PreflightError) as info:  # it was a survivor of the reap's wait: exit 10, restarted
        pf.run(dry_run=False)
    assert info.value.exit_code == ExitCode.PREFLIGHT_FAILED and "reap: survived SIGKILL" in info.value.message
    assert not log.events("preflight.unkillable")
    assert stuck.poll() is not None  # the premise: it was a survivor until its state was read


NFS_STACK = """[<0>] rpc_wait_bit_killable+0x1e/0xa0 [sunrpc]
[<0>] __rpc_execute+0x11e/0x3e0 [sunrpc]
[<0>] nfs4_do_call_sync+0x6e/0xb0 [nfsv4]
"""


def test_a_stale_companion_stuck_off_our_gpus_is_no_22_but_a_restartable_failure_naming_it(
    tmp_path: Path, spawner: ProcSpawner
) -> None:
    """Exit 22 is not restarted on, so it needs evidence that the GPU is why: NVML lists the survivor, or it waits
    in the NVIDIA driver. A stale tree's companion (its resource_tracker) in D state on a hung network mount has
    neither: it may still go (was: exit 22, "this deployment's GPUs need a reset"). Exit 10, naming it."""
    engine = spawner.python(
        "import subprocess, sys, time\n"
        "tracker = [sys.executable, '-c', 'import time; time.sleep(600)', 'multiprocessing.resource_tracker']\n"
        "c = subprocess.Popen(tracker)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)",
        title="VLLM::EngineCore",
    )
    assert engine.stdout is not None
    companion = psutil.Process(int(engine.stdout.readline()))
    try:
        fake_proc(tmp_path / "proc", companion.pid, "D (disk sleep)", "rpc_wait_bit_killable", NFS_STACK)
        probe = FakeGpuProbe([FakeGpu(), FakeGpu(occupants={engine.pid: 70000})])
        clock, log = FakeClock(), RecordingLog()
        pf = Preflight(make_cfg(tmp_path, gpus=[0, 1]), probe, StuckTable(companion.pid, tmp_path / "proc"), clock, log)
        with pytest.raises(PreflightError) as info:
            pf.run(dry_run=False)
        assert info.value.exit_code == ExitCode.PREFLIGHT_FAILED
        assert f"reap: survived SIGKILL PID {companion.pid}" in info.value.message
        assert not log.events("preflight.unkillable")
        assert engine.poll() is not None  # the premise: the stale engine, NVML's, was reaped; its companion was not
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            companion.kill()
