"""A process across time is (PID, start time), never its PID alone (docs/fault-matrix.md).

The multi-node systemd tier compares the vLLM processes of a machine before a fault with those after it
(`assert not old & new`): inside a container's small PID namespace a new process can get an old one's PID,
and that check failed once in CI after the group served again.  Here the reuse is made, not waited for: in a
PID namespace this test creates, a vLLM-titled process exits and the next one is put on its PID
(ns_last_pid), and the tier's own `Node.vllm_procs` reads both through the same script it runs in a machine.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from tests.conftest import wait_for
from tests.e2e.multinode_systemd import Node

# PID 1 of the namespace: a vLLM-titled process, then (after a line on stdin) its exit and a second one forced
# onto the same PID; after another line, the end (the namespace's processes die with its PID 1).
INIT = (
    "import os, subprocess, sys, time\n"
    "def worker():\n"
    "    return subprocess.Popen(['bash', '-c', 'exec -a VLLM::Worker_TP0 sleep 600'])\n"
    "a = worker()\n"
    "print(a.pid, flush=True)\n"
    "sys.stdin.readline()\n"
    "start = int(open(f'/proc/{a.pid}/stat').read().rsplit(')', 1)[1].split()[19])\n"
    "a.kill(); a.wait()\n"
    # Start times count clock ticks: the second one starts a tick later at least, whatever the machine's speed.
    "while time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf('SC_CLK_TCK') < start + 1:\n"
    "    time.sleep(0.001)\n"
    "with open('/proc/sys/kernel/ns_last_pid', 'w') as f:\n"
    "    f.write(str(a.pid - 1))\n"
    "b = worker()\n"
    "print(b.pid, flush=True)\n"
    "sys.stdin.readline()\n"
    "b.kill(); b.wait()\n"
)


class NamespaceMachine:
    """What Node needs of an NspawnMachine (`run`), inside the PID and mount namespace of `init`."""

    def __init__(self, init: int) -> None:
        self.init = init

    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        argv = ["nsenter", "-t", str(self.init), "-p", "-m", *argv]
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=timeout)


def test_a_reused_pid_is_another_process_for_the_multinode_tier() -> None:
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False).returncode != 0:
        pytest.skip("no PID namespaces here (unshare --pid failed)")
    ns = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INIT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert ns.stdin is not None and ns.stdout is not None
    try:
        first = int(ns.stdout.readline())
        [init] = wait_for(lambda: psutil.Process(ns.pid).children())  # type: ignore[misc]
        node = Node(NamespaceMachine(init.pid), 1, None)  # type: ignore[arg-type]
        old = node.vllm_procs()
        ns.stdin.write("next\n")
        ns.stdin.flush()
        second = int(ns.stdout.readline())
        new = node.vllm_procs()
        assert first == second  # the premise: the new process has the old one's PID
        assert {p.pid for p in old} == {p.pid for p in new} == {first}
        assert not old & new  # and still it is not the old process
    finally:
        ns.stdin.close()  # PID 1 reads EOF, kills the second worker and exits: the namespace ends with it
        try:
            ns.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ns.kill()
            ns.wait()
