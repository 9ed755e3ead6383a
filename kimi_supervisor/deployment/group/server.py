"""This node's status for the other supervisors of its multi-node group: one small read-only JSON document.

`GET /` answers `{"role", "node_rank", "deployment", "run_id", "state", "argv_digest", "peers"}` and nothing
else: what a peer needs to decide about *this* node (deployment/group/peers.py reads it), and how this node last saw
its peers (for `kimi-supervisor status`).  GET only (anything else is 405, and no request body is read), a
fixed document (under 400 bytes, plus ~80 per peer), no query or path does anything, nothing a client sends
reaches the lifecycle, and nothing in it is derived from a secret (the argv digest is over the redacted argv).

A peer protocol, not a page (docs/multi-node.md): the peers' looks decide whether the group restarts, so no client may
delay them.  Only the configured peers' addresses and this host's own are served (`PeerAddresses`); any other
is closed at once.  Every connection gets a thread of its own, at most MAX_CONNECTIONS in all and
MAX_PER_ADDRESS from one address (more are closed at once, never queued), and one deadline for the whole
request, however the client trickles it.  Who a client is rests on its address: a read-only document of
public facts needs no secret (docs/multi-node.md, "Who may read the status").
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import io
import json
import math
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kimi_supervisor.logs.types import Logger

# The whole request, from accept to its last header: a peer's GET takes milliseconds.
REQUEST_DEADLINE_S = 2.0
MAX_REQUEST_LINE = 1024
# A leader of 1023 followers is looked at by each once a second, each look a few milliseconds: 64 at once is
# ample; MAX_PER_ADDRESS keeps one address (a hostile local user on loopback) from taking every slot.
MAX_CONNECTIONS = 64
MAX_PER_ADDRESS = 4
RESOLVE_EVERY_S = 30.0
MAX_LOGGED_REFUSALS = 64
BUSY_LOG_EVERY_S = 60.0


def new_run_id() -> str:
    """A fresh id per vLLM spawn: a peer that sees it change knows the run it joined is over."""
    return secrets.token_hex(8)


class GroupStatus:
    """The document, updated by the loop (spawn, READY, STOPPING), read by the server thread."""

    def __init__(self, role: str, node_rank: int, deployment: str, argv_digest: str) -> None:
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {
            "role": role,
            "node_rank": node_rank,
            "deployment": deployment,
            "run_id": "",
            "state": "preflight",
            "argv_digest": argv_digest,
            # How this node last saw each peer (`kimi-supervisor status` shows it): {url: {state, run_id}}.
            "peers": {},
        }

    def set(self, state: str, run_id: str | None = None) -> None:
        with self._lock:
            self._doc["state"] = state
            if run_id is not None:
                self._doc["run_id"] = run_id

    def seen(self, url: str, state: str, run_id: str) -> None:
        with self._lock:
            self._doc["peers"][url] = {"state": state, "run_id": run_id}

    @property
    def state(self) -> str:
        with self._lock:
            return str(self._doc["state"])

    @property
    def run_id(self) -> str:
        with self._lock:
            return str(self._doc["run_id"])

    def body(self) -> bytes:
        with self._lock:
            return json.dumps(self._doc, separators=(",", ":")).encode()


class PeerAddresses:
    """Which client addresses are served: the configured peers' hosts (resolved) and this host's own.

    Names are resolved at start and again, in the background and at most every RESOLVE_EVERY_S, when an
    unknown address calls: the accept loop never waits on DNS.
    """

    def __init__(self, hosts: Iterable[str], local: Callable[[], Iterable[str]], log: Logger) -> None:
        self._hosts = tuple(dict.fromkeys(h for h in hosts if h))
        self._local = local
        self._log = log
        self._lock = threading.Lock()
        self._known: frozenset[str] = frozenset()
        self._resolved_at = -math.inf
        self._resolving = False
        self._refused: set[str] = set()
        self.resolve()

    def resolve(self) -> None:
        found = {_plain(a) for a in self._local()} | {"127.0.0.1", "::1"}
        for host in self._hosts:
            try:
                found |= {_plain(str(info[4][0])) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
            except OSError as exc:
                self._log.warning("group.peer_unresolved", host=host, error=str(exc))
        with self._lock:
            self._known = frozenset(found)
            self._resolved_at = time.monotonic()
            self._resolving = False

    def allows(self, address: str) -> bool:
        address = _plain(address)
        with self._lock:
            if address in self._known:
                return True
            again = not self._resolving and time.monotonic() - self._resolved_at >= RESOLVE_EVERY_S
            self._resolving = self._resolving or again
            first = address not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS
            if first:
                self._refused.add(address)
        if again:
            threading.Thread(target=self.resolve, name="kimi-status-resolve", daemon=True).start()
        if first:  # once per address: a scan of the cluster network is no flood of events
            self._log.warning("group.status_refused", client=address, why="not a configured peer of this node")
        return False


def _plain(address: str) -> str:
    """An IPv4 client of a dual-stack socket shows as ::ffff:a.b.c.d; a link-local one may carry %scope."""
    address = address.split("%", 1)[0]
    return address[7:] if address.startswith("::ffff:") and "." in address else address


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the request's one deadline: a client that
    trickles a byte at a time is cut off at the deadline, not after its last byte."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self._sock.settimeout(left)  # also bounds the answer's write, which follows the last read
        return self._sock.recv_into(buffer)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_DEADLINE_S
    server_version = "kimi-supervisor"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain makefile() reader: its per-recv timeout is no deadline
        reader = _DeadlineReader(self.connection, time.monotonic() + REQUEST_DEADLINE_S)
        self.rfile = io.BufferedReader(reader)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/", "/status"):
            self._answer(404, b'{"error":"not found"}')
            return
        self._answer(200, self.server.status.body())

    def do_HEAD(self) -> None:
        self._answer(405, b"")

    def _refuse(self) -> None:
        self._answer(405, b'{"error":"read-only: GET only"}')

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if len(getattr(self, "raw_requestline", b"")) > MAX_REQUEST_LINE:
            self.send_error(414)
            return False
        return True

    def log_message(self, format: str, *args: Any) -> None:
        return None  # a peer's probe every second is no event


class _Server(socketserver.TCPServer):
    allow_reuse_address = True  # a restarted supervisor binds again at once (TIME_WAIT)
    request_queue_size = MAX_CONNECTIONS
    status: GroupStatus
    peers: PeerAddresses
    log: Logger

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.Lock()
        self._active: collections.Counter[str] = collections.Counter()
        self._busy_logged = -math.inf

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread of its own for each served connection; the rest closed at once, never queued."""
        address = _plain(str(client_address[0]))
        if not self.peers.allows(address):
            self.shutdown_request(request)
            return
        with self._slots:
            busy = sum(self._active.values()) >= MAX_CONNECTIONS or self._active[address] >= MAX_PER_ADDRESS
            if not busy:
                self._active[address] += 1
        if busy:
            self.shutdown_request(request)
            self._note_busy(address)
            return
        thread = threading.Thread(
            target=self._serve_one, args=(request, client_address, address), name="kimi-status-conn", daemon=True
        )
        thread.start()

    def _serve_one(self, request: Any, client_address: Any, address: str) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._slots:
                self._active[address] -= 1
                if self._active[address] <= 0:
                    del self._active[address]

    def _note_busy(self, address: str) -> None:
        now = time.monotonic()
        with self._slots:
            if now - self._busy_logged < BUSY_LOG_EVERY_S:
                return
            self._busy_logged = now
            active = dict(self._active)
        self.log.warning("group.status_busy", client=address, connections=sum(active.values()), per_address=active)

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # a client that went away mid-answer is its own problem


@dataclasses.dataclass
class StatusServer:
    """Serves `status` on address:port to `peers` from daemon threads until `stop`."""

    status: GroupStatus
    address: str
    port: int
    log: Logger
    peers: PeerAddresses
    _server: _Server | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve; OSError (the port taken, the address not this host's) is the caller's to name."""
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        self._server = server_cls((self.address, self.port), _Handler)
        self._server.status = self.status
        self._server.peers = self.peers
        self._server.log = self.log
        self._thread = threading.Thread(target=self._server.serve_forever, name="kimi-status", daemon=True)
        self._thread.start()
        self.log.info("group.status_serving", address=self.address, port=self.bound_port)

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
