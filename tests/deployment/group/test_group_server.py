"""The status endpoint a group node serves its peers: GET only, a fixed small document, nothing else."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kimi_supervisor.clock import SystemClock
from kimi_supervisor.config.model import ClusterConfig
from kimi_supervisor.deployment.group import server as status_server
from kimi_supervisor.deployment.group.node import LeaderLiveness
from kimi_supervisor.deployment.group.peers import NetGroupProbe, Observation, PeerPoller
from kimi_supervisor.deployment.group.server import REQUEST_DEADLINE_S, GroupStatus, PeerAddresses, StatusServer
from kimi_supervisor.exitcodes import PeerLost
from kimi_supervisor.liveness.http import request
from testkit.fakes.log import RecordingLog
from testkit.harness import HANG_S
from tests.conftest import wait_for


def serving(hosts: tuple[str, ...] = (), log: RecordingLog | None = None) -> tuple[GroupStatus, StatusServer, str]:
    status = GroupStatus("follower", 1, "kimi", "ab" * 32)
    log = log if log is not None else RecordingLog()
    server = StatusServer(status, "127.0.0.1", 0, log, PeerAddresses(hosts, lambda: ["127.0.0.1"], log))
    server.start()
    return status, server, f"http://127.0.0.1:{server.bound_port}/"


def test_get_answers_the_document_and_follows_the_run() -> None:
    status, server, url = serving()
    try:
        answer = request("GET", url, 2.0)
        assert answer.http_status == 200 and len(answer.body) < 400
        assert json.loads(answer.body) == {
            "role": "follower",
            "node_rank": 1,
            "deployment": "kimi",
            "run_id": "",
            "state": "preflight",
            "argv_digest": "ab" * 32,
            "peers": {},
        }
        status.set("starting", "00ff")
        seen, error = NetGroupProbe().status(url, 2.0)
        assert error is None and seen is not None and (seen.state, seen.run_id) == ("starting", "00ff")
    finally:
        server.stop()


def test_read_only_and_bounded() -> None:
    status, server, url = serving()
    try:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            answer = request(method, url, 2.0, body=b'{"state":"stopping"}')
            assert answer.http_status == 405, method
        assert request("GET", url + "kill?pid=1", 2.0).http_status == 404
        assert status.state == "preflight" and status.run_id == ""  # nothing a client sent changed anything
        assert request("GET", url + "x" * 5000, 2.0).http_status == 414
        # A client that connects and sends nothing holds nothing: the next one is answered beside it.
        idle = socket.create_connection(("127.0.0.1", server.bound_port))
        try:
            answer = request("GET", url, REQUEST_DEADLINE_S + 2.0)
            assert answer.http_status == 200
        finally:
            idle.close()
    finally:
        server.stop()


class _FakeDeep:
    """The leader's own engine liveness (canary, progress): healthy; only the follower's looks are under test."""

    healthy = True

    def start(self) -> None: ...

    def check(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...

    def in_flight_sample(self) -> tuple[float, float] | None:
        return None


class _Trickler:
    """The issue's attack: connect, send one byte of a request line that never ends every `every_s`, and
    connect again as soon as the server hangs up; `cut` records each connection the server ended."""

    def __init__(self, port: int, every_s: float, source: str = "127.0.0.1") -> None:
        self.port, self.every_s, self.source = port, every_s, source
        self.stop = threading.Event()
        self.holding = threading.Event()  # a connection has sent two bytes and is still open
        self.cut: list[int] = []  # bytes sent on each connection the server closed
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            with socket.create_connection(("127.0.0.1", self.port), source_address=(self.source, 0)) as sock:
                sent = 0
                while not self.stop.is_set():
                    try:
                        sock.sendall(b"G" if sent == 0 else b"A")
                    except OSError:
                        break
                    sent += 1
                    if sent >= 2:
                        self.holding.set()
                    sock.settimeout(self.every_s)
                    try:
                        if sock.recv(4096) == b"":
                            break  # the server hung up: this connection is over
                    except TimeoutError:
                        continue  # still open: the next byte
                    except OSError:
                        break
                else:
                    return
                self.cut.append(sent)


def test_a_trickling_client_never_delays_a_peers_look_and_the_leader_does_not_exit_19() -> None:
    """Was (docs/multi-node.md): one byte every 0.5 s held the single-threaded endpoint forever (each recv got its byte
    within the 1 s socket timeout); every peer look timed out and after 3 the leader exited 19."""
    status, server, url = serving()
    status.set("ready", "aa01")
    trickler = _Trickler(server.bound_port, 0.5)
    trickler.thread.start()
    looks: list[Observation] = []
    cluster = ClusterConfig(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=1, peers=(url,))
    # Generous look timeouts (5 s): the old server never answered behind the trickler, whatever the timeout.
    poller = PeerPoller([url], None, lambda: None, interval_s=0.2, timeout_s=5.0)
    drain = poller.observations

    def recorded() -> list[Observation]:
        fresh = drain()
        looks.extend(fresh)
        return fresh

    poller.observations = recorded  # type: ignore[method-assign]
    leader = LeaderLiveness(_FakeDeep(), poller, cluster, SystemClock(), RecordingLog())
    try:
        assert trickler.holding.wait(30), "the trickler never held a connection"
        leader.start()
        deadline = time.monotonic() + 120
        while sum(1 for o in looks if o.status is not None) < 5:
            leader.check()  # PeerLost (exit 19) here is the bug
            assert time.monotonic() < deadline, f"no 5 good looks within 120 s: {[o.why for o in looks]}"
            time.sleep(0.05)
        assert all(o.status is not None for o in looks), [o.why for o in looks]
        # And the trickler itself is cut off (at the request's one deadline, 2 s, ~4 bytes): with a per-read timeout
        # each byte renewed, it was never cut.  Was also `< 30 bytes`, a speed; the wait only stops a hang.
        wait_for(lambda: trickler.cut, timeout=HANG_S)
    except PeerLost as exc:
        pytest.fail(f"the leader would exit 19: {exc}")
    finally:
        leader.stop()
        trickler.stop.set()
        trickler.thread.join(10)
        server.stop()


def test_only_configured_peers_and_this_host_are_served() -> None:
    log = RecordingLog()
    _, server, _ = serving(hosts=("127.0.0.3",), log=log)
    port = server.bound_port
    try:
        # 127.0.0.2 is on loopback but is neither this host's address (the test says 127.0.0.1) nor a peer's.
        for source, served in (("127.0.0.1", True), ("127.0.0.3", True), ("127.0.0.2", False), ("127.0.0.2", False)):
            with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    answer = sock.recv(4096)
                except ConnectionResetError:
                    answer = b""
            assert answer.startswith(b"HTTP/1.0 200") is served, (source, answer)
        refused = log.events("group.status_refused")
        assert refused == [{"client": "127.0.0.2", "why": "not a configured peer of this node"}]  # logged once
    finally:
        server.stop()


def test_excess_connections_are_closed_at_once_not_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    # A long deadline: the held connections stay held for the whole test, whatever this machine's speed.
    monkeypatch.setattr(status_server, "REQUEST_DEADLINE_S", 300.0)
    _, server, url = serving(hosts=("127.0.0.2",))
    held = []
    try:
        for _ in range(status_server.MAX_PER_ADDRESS):
            held.append(socket.create_connection(("127.0.0.1", server.bound_port), source_address=("127.0.0.2", 0)))
        with socket.create_connection(
            ("127.0.0.1", server.bound_port), timeout=60, source_address=("127.0.0.2", 0)
        ) as extra:
            extra.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                answer = extra.recv(4096)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # closed unanswered at once (queued, this recv would wait out the 300 s)
        # Another address still has its slots: a peer is never starved by one hostile address.
        assert request("GET", url, 30.0).http_status == 200
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_peer_addresses_are_the_configured_hosts_and_this_hosts_own() -> None:
    log = RecordingLog()
    peers = PeerAddresses(["10.99.0.1", ""], lambda: ["192.0.2.7"], log)
    assert peers.allows("10.99.0.1") and peers.allows("::ffff:10.99.0.1") and peers.allows("192.0.2.7")
    assert peers.allows("127.0.0.1")  # `kimi-supervisor status` reads its own node's endpoint
    assert not peers.allows("10.99.0.2")
