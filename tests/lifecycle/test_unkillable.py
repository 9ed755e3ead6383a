"""A tree member that outlives SIGKILL: exit 22 at once, naming the GPU, the process, its state and wait channel.

The fake world's child (testkit/fakes/lifecycle.py) stays alive after SIGKILL as a process in D state does; what
/proc says of it comes from the fake process table (real-format reading: tests/host/test_procstate.py).  The
real-process counterpart, the real CLI with a worker the test freezes: tests/lifecycle/test_unkillable_frozen.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

from kimi_supervisor.config.timeouts import SIGKILL_WAIT_S
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.host.procstate import ProcState
from kimi_supervisor.states import State
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
