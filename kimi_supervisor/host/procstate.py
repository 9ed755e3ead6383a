"""What a process is doing in the kernel: its state, wait channel and kernel stack, read from a /proc root.

A process that outlives SIGKILL is stuck in the kernel, nearly always in uninterruptible sleep (state D);
vLLM's users have seen an EngineCore stuck in the NVIDIA driver (nvidia_uvm) through kill -9, which only a
GPU reset or a reboot frees.  This module reads what /proc says about it, for the operator's message and for
the decision not to restart into GPUs that never free (lifecycle/stopping.py's `unkillable`, the preflight's
reap).
/proc/PID/stack is often root-only and /proc/PID/wchan readable more often: each is None when unreadable,
never a guess.  The root is a parameter so tests feed real-format files (tests/host/test_procstate.py).
"""

from __future__ import annotations

import dataclasses
import re

# The NVIDIA kernel modules' symbols: nvidia.ko (nv_*, _nv012345rm, os_*: its OS layer, only in a stack with a
# [nvidia] module tag) and nvidia-uvm.ko (uvm_*).  Not "nv" alone: nvme_* is the disk driver, whose D state is
# ordinary I/O.
_NVIDIA_SYMBOL = re.compile(r"^(uvm_|nvidia_|nv_|_nv\d|_nv_)")
_NVIDIA_MODULE = re.compile(r"\[(nvidia[\w-]*)\]")
STACK_LINES_KEPT = 8


@dataclasses.dataclass(frozen=True)
class ProcState:
    pid: int
    name: str
    state: str  # /proc/PID/status's State: "D (disk sleep)", "S (sleeping)", ...; "" when unreadable
    wchan: str | None  # the kernel function it waits in; None: unreadable, "" or "0": not waiting
    stack: tuple[str, ...] | None  # kernel stack frames ("uvm_spin_loop+0x9c/0x1d0 [nvidia_uvm]"); None: unreadable

    @property
    def uninterruptible(self) -> bool:
        return self.state.startswith("D")

    @property
    def in_nvidia_driver(self) -> bool:
        """Its wait channel or a kernel stack frame is NVIDIA's driver (only what could be read counts)."""
        if self.wchan and _NVIDIA_SYMBOL.match(self.wchan):
            return True
        return any(_NVIDIA_MODULE.search(f) or _NVIDIA_SYMBOL.match(f) for f in self.stack or ())

    def describe(self) -> str:
        """`PID 4242 (VLLM::EngineCore), state D (disk sleep), waiting in uvm_spin_loop` and the stack's head."""
        parts = [f"PID {self.pid} ({self.name})", f"state {self.state or 'unknown'}"]
        if self.wchan and self.wchan != "0":
            parts.append(f"waiting in {self.wchan}")
        elif self.wchan is None:
            parts.append("wait channel unreadable")
        if self.stack:
            parts.append("kernel stack " + " < ".join(self.stack[:3]))
        return ", ".join(parts)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(64 * 1024)
    except OSError:
        return None


def _frame(line: str) -> str:
    # "[<0>] uvm_spin_loop+0x9c/0x1d0 [nvidia_uvm]": the address part (zeroed without CAP_SYSLOG) says nothing.
    return line.split("] ", 1)[1].strip() if line.startswith("[<") and "] " in line else line.strip()


def read_state(pid: int, proc_root: str = "/proc") -> ProcState | None:
    """The process's kernel-side state; None when `pid` is gone (no status file)."""
    status = _read(f"{proc_root}/{pid}/status")
    if status is None:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    name = fields.get("Name", "").strip() or "?"
    state = fields.get("State", "").strip()
    wchan = _read(f"{proc_root}/{pid}/wchan")
    stack_text = _read(f"{proc_root}/{pid}/stack")
    stack = None
    if stack_text is not None:
        stack = tuple(f for f in (_frame(line) for line in stack_text.splitlines()) if f)[:STACK_LINES_KEPT]
    return ProcState(pid, name, state, wchan.strip() if wchan is not None else None, stack)


def needs_reset(gpus: tuple[int, ...], stuck: list[ProcState], what: str) -> str:
    """The operator's one line: which GPUs, then each stuck process; `what` says how it proved unkillable."""
    if len(gpus) == 1:
        head = f"GPU {gpus[0]} needs a reset or the host a reboot"
    elif gpus:
        head = f"GPUs {', '.join(map(str, gpus))} need a reset or the host a reboot"
    else:
        head = "this deployment's GPUs need a reset or the host a reboot"
    driver = " in the NVIDIA driver" if any(s.in_nvidia_driver for s in stuck) else ""
    return f"{head}: {what}{driver}: " + "; ".join(s.describe() for s in stuck)
