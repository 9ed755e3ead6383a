"""This node's status for the other supervisors of its multi-node group: one small read-only JSON document.

`GET /` answers `{"role", "node_rank", "deployment", "run_id", "state", "argv_digest", "peers"}` and nothing
else: what a peer needs to decide about *this* node (liveness/peers.py reads it), and how this node last saw
its peers (for `kimi-supervisor status`).  The endpoint is safe to leave unauthenticated on the cluster
network: GET only (anything else is 405, and no request body is read), a fixed document (under 400 bytes,
plus ~80 per peer), no query or path does anything, and nothing a client sends reaches the lifecycle, so no
peer can make a supervisor kill or run anything.  One thread serves one connection at a time, each with a
short socket timeout: a slow or hostile client delays the next one by at most that, and holds nothing else.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import secrets
import socket
import socketserver
import threading
from typing import Any

from kimi_supervisor.logs.types import Logger

CONNECTION_TIMEOUT_S = 1.0
MAX_REQUEST_LINE = 1024


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


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = CONNECTION_TIMEOUT_S
    server_version = "kimi-supervisor"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers

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
    status: GroupStatus

    def handle_error(self, request: Any, client_address: Any) -> None:
        return None  # a client that went away mid-answer is its own problem


@dataclasses.dataclass
class StatusServer:
    """Serves `status` on address:port from a daemon thread until `stop`."""

    status: GroupStatus
    address: str
    port: int
    log: Logger
    _server: _Server | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        self._server = server_cls((self.address, self.port), _Handler)
        self._server.status = self.status
        self._server.timeout = CONNECTION_TIMEOUT_S
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
