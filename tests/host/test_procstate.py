"""procstate reads a process's kernel state from a /proc root: real-format files here, the real /proc once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kimi_supervisor.host.procstate import ProcState, needs_reset, read_state
from tests.conftest import wait_for

# /proc/PID/stack of an EngineCore stuck in nvidia_uvm, addresses zeroed as without CAP_SYSLOG.
UVM_STACK = """[<0>] uvm_spin_loop+0x9c/0x1d0 [nvidia_uvm]
[<0>] uvm_tracker_wait+0x6e/0x150 [nvidia_uvm]
[<0>] uvm_va_space_destroy+0x2b1/0x540 [nvidia_uvm]
[<0>] uvm_release+0x1c/0x30 [nvidia_uvm]
[<0>] __fput+0xff/0x2a0
[<0>] do_exit+0x2e8/0xae0
[<0>] get_signal+0x9a5/0x9e0
"""
STATUS = "Name:\tVLLM::EngineCor\nUmask:\t0022\nState:\t{state}\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t1\n"


def fake_proc(root: Path, pid: int, state: str, wchan: str | None = None, stack: str | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(STATUS.format(state=state, pid=pid))
    if wchan is not None:
        (d / "wchan").write_text(wchan)
    if stack is not None:
        (d / "stack").write_text(stack)


def test_an_engine_stuck_in_nvidia_uvm_reads_as_d_state_in_the_driver(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4242, "D (disk sleep)", "uvm_spin_loop", UVM_STACK)
    s = read_state(4242, str(tmp_path))
    assert s is not None
    assert (s.name, s.state, s.wchan) == ("VLLM::EngineCor", "D (disk sleep)", "uvm_spin_loop")
    assert s.stack is not None and s.stack[0] == "uvm_spin_loop+0x9c/0x1d0 [nvidia_uvm]"
    assert s.uninterruptible and s.in_nvidia_driver
    text = needs_reset((3,), [s], "it outlived SIGKILL by 5s")
    assert text.startswith("GPU 3 needs a reset or the host a reboot: it outlived SIGKILL by 5s in the NVIDIA driver: ")
    assert "PID 4242 (VLLM::EngineCor), state D (disk sleep), waiting in uvm_spin_loop" in text


def test_the_stack_unreadable_the_wait_channel_alone_names_the_driver(tmp_path: Path) -> None:
    fake_proc(tmp_path, 7, "D (disk sleep)", "_nv012345rm")  # no stack file: root-only, as it often is
    s = read_state(7, str(tmp_path))
    assert s is not None and s.stack is None and s.in_nvidia_driver


def test_nvme_io_and_an_unreadable_wait_are_not_the_nvidia_driver(tmp_path: Path) -> None:
    nvme_stack = "[<0>] io_schedule+0x12/0x40\n[<0>] nvme_poll+0x1/0x2 [nvme]\n"
    fake_proc(tmp_path, 8, "D (disk sleep)", "nvme_poll", nvme_stack)
    fake_proc(tmp_path, 9, "D (disk sleep)")
    nvme, unknown = read_state(8, str(tmp_path)), read_state(9, str(tmp_path))
    assert nvme is not None and not nvme.in_nvidia_driver
    assert unknown is not None and unknown.wchan is None and not unknown.in_nvidia_driver
    assert "wait channel unreadable" in unknown.describe()
    assert read_state(10, str(tmp_path)) is None  # gone
    assert needs_reset((0, 1), [nvme], "x").startswith("GPUs 0, 1 need a reset or the host a reboot: x: PID 8")


def test_a_real_sleeping_process_reads_as_sleeping_with_its_wait_channel() -> None:
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # about to block in its read

        def sleeping() -> ProcState | None:
            s = read_state(proc.pid)
            return s if s is not None and s.state.startswith("S") else None

        s = wait_for(sleeping, timeout=10)
        assert isinstance(s, ProcState) and s.state == "S (sleeping)" and s.name.startswith("python")
        assert not s.uninterruptible and not s.in_nvidia_driver  # wchan: a kernel function (or "0" when hidden)
    finally:
        proc.kill()
        proc.wait()
