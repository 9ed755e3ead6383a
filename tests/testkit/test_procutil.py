"""The /proc helpers the tests, the fake vLLM and the benches share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from testkit.procutil import claim_port, free_port, live, port_window, proc_ppid, proc_state


def test_state_of_a_live_a_zombie_and_a_reaped_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert live(child.pid) and proc_state(child.pid) in "RS"
        assert proc_ppid(child.pid) == os.getpid()
    finally:
        assert child.stdin is not None
        child.stdin.close()
    deadline = time.monotonic() + 10
    while proc_state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc_state(child.pid) == "Z" and not live(child.pid)
    child.wait()
    assert proc_state(child.pid) == "-" and proc_ppid(child.pid) is None and not live(child.pid)


def test_set_comm_keeps_15_bytes() -> None:
    code = "import sys; sys.path.insert(0, sys.argv[1]); from testkit.procutil import set_comm; set_comm(sys.argv[2]);"
    code += "print(open('/proc/self/comm').read().strip())"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code, repo, "VLLM::Worker_TP12"], capture_output=True, text=True)
    assert out.stdout.strip() == "VLLM::Worker_TP"


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_outside_the_kernels_ephemeral_range() -> None:
    # A port from the ephemeral range can become any connect()'s source port between the pick and the child's
    # bind (CI: a supervisor refused its start with exit 10, "port ... already in use"); outside it, only a bind can.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        low, high = (int(f) for f in fh.read().split())
    ports = [free_port() for _ in range(50)]
    assert all(not low <= p <= high for p in ports), [p for p in ports if low <= p <= high]
    assert all(1024 <= p < 65536 for p in ports)


def test_port_window_lies_beside_the_ephemeral_range() -> None:
    assert port_window((32768, 60999)) == range(16384, 32768)
    assert port_window((1024, 60999)) == range(61000, 65536)  # no room below: above it


def test_free_port_never_hands_the_same_port_twice_across_processes() -> None:
    # The claim is host-wide: a port this process holds is never another test process's, and the other way round.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from testkit.procutil import free_port;"
        "print(*[free_port() for _ in range(300)]); sys.stdout.flush(); sys.stdin.read()"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code, repo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        theirs = {int(p) for p in other.stdout.readline().split()}
        assert len(theirs) == 300
        mine = {free_port() for _ in range(300)}
        assert len(mine) == 300 and not mine & theirs
        assert not any(claim_port(p) for p in sorted(theirs)[:20])  # held by the other process
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
    assert claim_port(sorted(theirs)[0])  # released with the process that held it
