"""Looking at the other nodes of a multi-node group: their supervisors' status, the leader's master port.

vLLM's mp executor watches only a node's own workers: an idle leader never notices a dead follower (its
/health stays 200), and an idle follower never notices a dead leader (it waits on a ZMQ socket forever).
So each supervisor reads its peers' status endpoints (deployment/group/server.py serves ours), and a follower
also connects to the leader's master port (the TCPStore lives in the leader's rank-0 worker for the whole
life of the group; a connect and close is harmless, research 3.2).  What a peer sends is untrusted: a
bounded body, parsed into a fixed shape, and it only ever informs a verdict about that peer.

A `PeerPoller` thread does the I/O every `probe_interval_s` and keeps the observations for the loop; the
verdicts are deployment/group/node.py's, in fake time.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kimi_supervisor.liveness.http import HttpClient, one_line, request
from kimi_supervisor.untrusted_json import parse_json

MAX_STATUS_BODY = 256 * 1024  # our own document: < 400 bytes plus ~80 per peer (a leader of 1023 followers)
# States a supervisor publishes (deployment/group/server.py): the lifecycle's, plus "waiting" (a follower
# waiting for its leader, nothing of ours running).
PEER_STATES = ("preflight", "waiting", "starting", "ready", "stopping", "stopped", "failed")
_RUN_ID = re.compile(r"^[0-9a-f]{1,64}$")
MAX_DEPLOYMENT = 255
_DIGEST = re.compile(r"^[0-9a-f]{0,64}$")


@dataclasses.dataclass(frozen=True)
class PeerStatus:
    """One supervisor's published status, as read (every field checked: nothing else is kept)."""

    role: str
    node_rank: int
    run_id: str  # "" before its first spawn
    state: str
    argv_digest: str
    deployment: str = ""

    def mismatch(self, role: str, deployment: str, argv_digest: str) -> str | None:
        """Why this document is not the peer our config names (another role, deployment or argv), or None.

        A document is only believed about the node it claims to be: anyone who binds a node's status port
        (while its supervisor is down) could otherwise pose as it."""
        if self.role != role:
            return f"role {self.role!r}, expected {role!r}"
        if self.deployment != deployment:
            return f"deployment {one_line(repr(self.deployment), 80)}, expected {deployment!r}"
        if self.argv_digest != argv_digest:
            return "another argv (its argv_digest differs: child.argv must be the same on every node)"
        return None


def parse_status(body: bytes) -> PeerStatus:
    """The fixed document, or ValueError with a one-line reason."""
    if len(body) > MAX_STATUS_BODY:
        raise ValueError(f"status document of {len(body)} bytes (at most {MAX_STATUS_BODY})")
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise ValueError("status document is not a JSON object")
    role, rank, run_id = doc.get("role"), doc.get("node_rank"), doc.get("run_id")
    state, digest = doc.get("state"), doc.get("argv_digest", "")
    deployment = doc.get("deployment", "")
    if role not in ("leader", "follower"):
        raise ValueError(f"role: expected 'leader' or 'follower', got {one_line(repr(role), 40)}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1024:
        raise ValueError(f"node_rank: expected 0..1023, got {one_line(repr(rank), 40)}")
    if not isinstance(run_id, str) or not (run_id == "" or _RUN_ID.match(run_id)):
        raise ValueError(f"run_id: expected hex digits, got {one_line(repr(run_id), 40)}")
    if state not in PEER_STATES:
        raise ValueError(f"state: expected one of {', '.join(PEER_STATES)}, got {one_line(repr(state), 40)}")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ValueError(f"argv_digest: expected hex digits, got {one_line(repr(digest), 40)}")
    if not isinstance(deployment, str) or len(deployment) > MAX_DEPLOYMENT:
        raise ValueError(f"deployment: expected a name, got {one_line(repr(deployment), 40)}")
    return PeerStatus(role, rank, run_id, state, digest, deployment)


class PortState(enum.Enum):
    OPEN = "open"
    REFUSED = "refused"  # nothing listens: the leader's vLLM is not (yet, or any longer) at its rendezvous
    TIMEOUT = "timeout"  # no answer at all: a firewall, a partition, a host gone
    UNREACHABLE = "unreachable"  # no route, host unreachable, a name that does not resolve


def probe_port(addr: str, port: int, timeout_s: float) -> tuple[PortState, str]:
    """One TCP connect and close to addr:port: how it went, and the error's words."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return PortState.OPEN, ""
    except ConnectionRefusedError:
        return PortState.REFUSED, "connection refused"
    except TimeoutError:
        return PortState.TIMEOUT, f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return PortState.UNREACHABLE, one_line(f"{type(exc).__name__}: {exc}")


@dataclasses.dataclass(frozen=True)
class Observation:
    """One look at one peer: its status (None: no valid answer, `error` says why), the port where asked."""

    url: str
    at: float  # monotonic, when the look ended
    status: PeerStatus | None
    error: str | None = None
    port: PortState | None = None  # the leader's master port, on a follower's looks only
    port_error: str = ""

    @property
    def reachable(self) -> bool:
        return self.status is not None and self.port in (None, PortState.OPEN)

    @property
    def why(self) -> str:
        if self.status is None:
            return f"status {self.url}: {self.error}"
        if self.port not in (None, PortState.OPEN):
            return f"master port {self.port.value if self.port else ''}: {self.port_error}"
        return f"{self.url}: {self.status.state}"


class GroupProbe(Protocol):
    """The network side of one look; tests pass a fake."""

    def status(self, url: str, timeout_s: float) -> tuple[PeerStatus | None, str | None]: ...

    def port(self, addr: str, port: int, timeout_s: float) -> tuple[PortState, str]: ...


@dataclasses.dataclass
class NetGroupProbe:
    http: HttpClient = request

    def status(self, url: str, timeout_s: float) -> tuple[PeerStatus | None, str | None]:
        answer = self.http("GET", url, timeout_s, max_body=MAX_STATUS_BODY)
        if answer.error is not None:
            return None, answer.error
        if answer.http_status != 200:
            return None, f"HTTP {answer.http_status}"
        try:
            return parse_status(answer.body), None
        except ValueError as exc:
            return None, one_line(str(exc))

    def port(self, addr: str, port: int, timeout_s: float) -> tuple[PortState, str]:
        return probe_port(addr, port, timeout_s)


class Poller(Protocol):
    """Looks at the peers in the background; the loop takes what came (`observations`)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def observations(self) -> list[Observation]: ...


class PollerFactory(Protocol):
    def __call__(self, urls: Sequence[str], master: tuple[str, int] | None, wake: Callable[[], None]) -> Poller: ...


class PeerPoller:
    """A daemon thread: every interval, one look at each URL (and the master port, when given)."""

    def __init__(
        self,
        urls: Sequence[str],
        master: tuple[str, int] | None,
        wake: Callable[[], None],
        *,
        interval_s: float,
        timeout_s: float,
        probe: GroupProbe | None = None,
    ) -> None:
        self._urls = tuple(urls)
        self._master = master
        self._wake = wake
        self._interval = interval_s
        self._timeout = timeout_s
        self._probe: GroupProbe = probe if probe is not None else NetGroupProbe()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Bounded: a loop that stopped taking them (while stopping the tree) keeps only the newest looks.
        self._results: collections.deque[Observation] = collections.deque(maxlen=64)
        self._thread = threading.Thread(target=self._loop, name="kimi-peers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def observations(self) -> list[Observation]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            for url in self._urls:
                self._look(url)
            self._stop.wait(self._interval)

    def _look(self, url: str) -> None:
        status, error = self._probe.status(url, self._timeout)
        port, port_error = None, ""
        if self._master is not None:
            port, port_error = self._probe.port(self._master[0], self._master[1], self._timeout)
        with self._lock:
            self._results.append(Observation(url, time.monotonic(), status, error, port, port_error))
        self._wake()
