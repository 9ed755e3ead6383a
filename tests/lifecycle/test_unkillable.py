"""A tree member that outlives SIGKILL: exit 22 at once, naming the GPU, the process, its state and wait channel.

The fake world's child (testkit/fakes/lifecycle.py) stays alive after SIGKILL as a process in D state does; what
/proc says of it comes from the fake process table (real-format reading: tests/host/test_procstate.py).  The
real-process counterpart, the real CLI with a worker the test freezes: tests/lifecycle/test_unkillable_frozen.py.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.host.procstate import ProcState
from kimi_supervisor.host.proctable import ProcInfo
from kimi_supervisor.states import State
from testkit.fakes.clock import T0
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle import FakeChild
from testkit.fakes.lifecycle_world import HEALTH_LINE, World, serving_world

STUCK = ProcState(
    4242, "VLLM::EngineCor", "D (disk sleep)", "uvm_spin_loop", ("uvm_spin_loop+0x9c/0x1d0 [nvidia_uvm]",)
)


def stuck_world(tmp_path: Path, stop_at: float = 3.0) -> World:
    gpus = [FakeGpu(), FakeGpu()]
    probe = FakeGpuProbe(gpus, alive=lambda pid: True)
    shutdown = {"grace_s": 2, "gpu_release_timeout_s": 30}
    w = serving_world(tmp_path, preflight={"gpus": [0, 1]}, shutdown=shutdown, probe=probe)

    def stuck(child: FakeChild) -> None:
        child.survives_sigkill, child.term_exit_after = True, None
        w.table.states[child.pid] = STUCK
        gpus[1].occupants[child.pid] = 70000  # NVML lists it on GPU 1 only

    w.script = stuck
    w.say_at(2.0, HEALTH_LINE)
    w.signal_at(stop_at)
    return w


def test_a_member_that_outlives_sigkill_ends_the_run_with_22_naming_gpu_process_state_and_wait(
    tmp_path: Path,
) -> None:
    w = stuck_world(tmp_path)
    assert w.run() == ExitCode.GPU_NEEDS_RESET
    child = w.child
    assert child is not None and w.error is not None
    [(_, term), (t_kill, kill)] = child.signals  # no emergency stop after: it would only wait again
    assert (term, kill) == (signal.SIGTERM, signal.SIGKILL)
    message = w.error.message
    assert message.startswith("GPU 1 needs a reset or the host a reboot: 1 process(es) of vLLM's tree outlived")
    assert "in the NVIDIA driver: PID 4242 (VLLM::EngineCor), state D (disk sleep), waiting in uvm_spin_loop" in message
    [event] = w.events("stop.unkillable")
    assert (event["pid"], event["wchan"]) == (4242, "uvm_spin_loop")
    assert not w.events("stop.gpu_wait") and not w.events("stop.gpu_still_busy")
    assert w.supervisor.state.history[-1] is State.FAILED
    # what systemd shows: STATUS= says it plainly
    assert any("needs a reset or the host a reboot" in str(f.get("STATUS")) for _, f in w.notes.sent)
    assert w.clock.t >= t_kill + SIGKILL_WAIT_S


def test_a_survivor_whose_pid_names_a_newcomer_when_it_is_read_is_not_stuck(tmp_path: Path) -> None:
    """A member alive at the end of the SIGKILL wait that goes right after (the driver let it go at 5.01 s) frees
    its PID; in a container's small PID namespace a newcomer can hold it when /proc is read. That newcomer's
    state is not the survivor's: exit 22 (not restarted on, "GPU needs a reset") would be wrong. The survivor is
    (PID, start time): the table's process on that PID started 10 s later, so nothing is stuck and the stop goes
    on to the GPU wait."""
    w = stuck_world(tmp_path)

    def newcomer_on_the_pid() -> None:  # during the SIGKILL wait, once the member was listed as a survivor
        child = w.child
        assert child is not None
        stranger = ProcInfo(child.pid, 1, "bash", ("bash",), 0, 1, T0 + 10.0)
        w.table.add(stranger, lambda: True)
        w.table.states[child.pid] = ProcState(child.pid, "bash", "S (sleeping)", "do_wait", None)

    w.clock.at(3.0 + 2.0 + SIGKILL_WAIT_S - 0.05, newcomer_on_the_pid)  # the stop at 3 s, 2 s grace, then SIGKILL
    rc = w.run()
    assert not w.events("stop.unkillable")
    assert rc != ExitCode.GPU_NEEDS_RESET, w.error
    assert w.events("stop.survivors")  # the member was a survivor when the wait ended: the premise


FROZEN = ProcState(4242, "VLLM::Worker_TP", "D (disk sleep)", "__refrigerator", ("__refrigerator+0x4f/0x150",))


def evidence_world(tmp_path: Path, state: ProcState, listed: bool) -> World:
    """A survivor in `state`, NVML listing it on GPU 1 or not; /health fails from 3 s on (exit 14, restarted)."""
    gpus = [FakeGpu(), FakeGpu()]
    probe = FakeGpuProbe(gpus, alive=lambda pid: True)
    w = serving_world(tmp_path, preflight={"gpus": [0, 1]}, shutdown={"grace_s": 2}, probe=probe)

    def stuck(child: FakeChild) -> None:
        child.survives_sigkill, child.term_exit_after = True, None
        w.table.states[child.pid] = dataclasses.replace(state, pid=child.pid)
        if listed:
            gpus[1].occupants[child.pid] = 70000

    w.script = stuck
    w.health = lambda t: 200 if 1.0 <= t < 3.0 else (None if t < 1.0 else 500)
    w.say_at(2.0, HEALTH_LINE)
    return w


def test_a_survivor_nothing_ties_to_the_gpu_keeps_the_runs_restartable_exit(tmp_path: Path) -> None:
    """A CPU-only worker frozen (or waiting on a hung network mount) past the SIGKILL wait: NVML lists it nowhere
    and its wait is not NVIDIA's. It may still go, so no 22 (never restarted): the run keeps its exit 14, and the
    survivor is named (was: exit 22 for any survivor)."""
    w = evidence_world(tmp_path, FROZEN, listed=False)
    assert w.run() == ExitCode.CHILD_UNHEALTHY
    child = w.child
    assert child is not None
    assert [s for _, s in child.signals] == [signal.SIGTERM, signal.SIGKILL]  # the premise: it outlived SIGKILL
    [event] = w.events("stop.unkillable")
    assert (event["pid"], event["wchan"], event["gpu"]) == (child.pid, "__refrigerator", "")
    assert w.events("stop.survivors_not_gpu")[0]["pids"] == str(child.pid)
    assert not any("needs a reset" in str(f.get("STATUS")) for _, f in w.notes.sent)


def test_a_survivor_nvml_lists_is_22_whatever_it_waits_in(tmp_path: Path) -> None:
    w = evidence_world(tmp_path, FROZEN, listed=True)
    assert w.run() == ExitCode.GPU_NEEDS_RESET
    assert w.error is not None and w.error.message.startswith("GPU 1 needs a reset or the host a reboot")
    assert w.events("stop.unkillable")[0]["gpu"] == "NVML lists it on our GPUs"


def test_a_survivor_in_the_nvidia_driver_nvml_does_not_list_is_22_for_all_our_gpus(tmp_path: Path) -> None:
    """Another PID namespace, or NVML gone: the wait channel and stack are the evidence, and every GPU of ours is
    named, since NVML cannot say which."""
    w = evidence_world(tmp_path, STUCK, listed=False)
    assert w.run() == ExitCode.GPU_NEEDS_RESET
    assert w.error is not None and w.error.message.startswith("GPUs 0, 1 need a reset or the host a reboot")
    assert w.events("stop.unkillable")[0]["gpu"] == "waits in the NVIDIA driver"
