"""Two network namespaces joined by a veth pair, for the multi-node tiers (tests/e2e/test_vllm_multinode*.py).

The leader's end gets NET.1, the follower's NET.2, both /24; nothing touches the host's network.  Both
namespaces, and so the pair, are this test's alone: `down` kills what is left in them (nothing else can have
entered them) and deletes them, failure or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from tests.conftest import wait_for


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class NetPair:
    """`prefix` tells the tiers' namespaces apart (both files may run in one pytest process: one pid)."""

    def __init__(self, net: str, prefix: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.net = net
        self.leader, self.follower = f"kimi-{prefix}l{tag}", f"kimi-{prefix}f{tag}"
        self.lif, self.fif = f"k{prefix}l{tag}", f"k{prefix}f{tag}"
        self.made: list[str] = []

    def addr(self, rank: int) -> str:
        return f"{self.net}.{rank + 1}"

    def ns(self, rank: int) -> str:
        return self.leader if rank == 0 else self.follower

    def dev(self, rank: int) -> str:
        return self.lif if rank == 0 else self.fif

    def up(self) -> None:
        for ns in (self.leader, self.follower):
            _ip("netns", "add", ns)
            self.made.append(ns)
        _ip("link", "add", self.lif, "type", "veth", "peer", "name", self.fif)
        for rank in (0, 1):
            _ip("link", "set", self.dev(rank), "netns", self.ns(rank))
            _ip("-n", self.ns(rank), "addr", "add", f"{self.addr(rank)}/24", "dev", self.dev(rank))
            _ip("-n", self.ns(rank), "link", "set", self.dev(rank), "up")
            _ip("-n", self.ns(rank), "link", "set", "lo", "up")

    def set_link(self, rank: int, up: bool) -> None:
        """Node `rank`'s end of the pair down (a silent partition: the peer sees no carrier, nothing is
        refused, packets just go nowhere) or up again (the connected route comes back with it)."""
        _ip("-n", self.ns(rank), "link", "set", self.dev(rank), "up" if up else "down")

    def pids(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
        return [int(p) for p in out.split()]

    def down(self) -> None:
        # Run after the machines or supervisors are gone: anything still in our namespaces is ours.  Deleting a
        # namespace deletes the veth end in it, and with it the pair.
        for ns in self.made:
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns in self.made:
            with contextlib.suppress(AssertionError):  # wait_for raises it: delete anyway
                wait_for(lambda ns=ns: not self.pids(ns), timeout=20)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        # A veth made before a failed move is still on the host: delete it by name (ours: our pid in it).
        subprocess.run(["ip", "link", "del", self.lif], capture_output=True, timeout=10)
