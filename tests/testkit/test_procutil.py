"""The /proc helpers the tests, the fake vLLM and the benches share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from testkit.procutil import free_port, live, proc_ppid, proc_state


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
