"""Health probes against real sockets: refused, 200, 503, and a server that never answers."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kimi_supervisor.liveness.health_probe import HealthProber, probe
from testkit.harness import free_port, http_server
from tests.conftest import wait_for


class Handler(http.server.BaseHTTPRequestHandler):
    status = 200
    hits = 0  # requests served

    def do_GET(self) -> None:
        type(self).hits += 1
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def server() -> Iterator[tuple[str, type[Handler]]]:
    handler = type("H", (Handler,), {"status": 200})
    with http_server(handler) as base:
        yield f"{base}/health", handler


def test_refused_is_a_quiet_failure() -> None:
    r = probe(f"http://127.0.0.1:{free_port()}/health", 1.0)
    assert (r.ok, r.http_status, r.error) == (False, None, "connection refused")


def test_200_and_503(server: tuple[str, type[Handler]]) -> None:
    url, handler = server
    assert probe(url, 1.0).ok
    handler.status = 503
    r = probe(url, 1.0)
    assert (r.ok, r.http_status, r.error) == (False, 503, "HTTP 503")


def test_accepting_but_silent_server_times_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        start = time.monotonic()
        r = probe(f"http://127.0.0.1:{s.getsockname()[1]}/health", 0.3)
        assert (r.ok, r.error) == (False, "no answer within 0.3s")
        # The server never answers: only the deadline can have ended the probe (no upper bound in wall time, which
        # would measure this machine's load, not the probe).
        assert time.monotonic() - start > 0.25


def test_prober_thread_queues_results_and_wakes(server: tuple[str, type[Handler]]) -> None:
    url, handler = server
    woken = threading.Event()
    prober = HealthProber(url, 1.0, 0.05, woken.set)
    prober.start()
    try:
        assert woken.wait(30)  # stops a hung test
        # The prober probes one at a time: its 3rd result is queued before its 4th request.  Counted, however long
        # this machine takes (was: >= 3 results after a 0.3 s sleep, its speed); nobody read them meanwhile.
        wait_for(lambda: handler.hits >= 4, timeout=30)
        results = prober.new_results()
        assert len(results) >= 3 and all(r.ok for r in results)
    finally:
        prober.stop()


ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def test_trickling_server_fails_at_the_overall_deadline() -> None:
    """One byte every 0.5 s never trips a per-recv timeout; the probe's deadline still ends it."""
    stop = threading.Event()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()

        def trickle() -> None:
            conn, _ = srv.accept()
            with conn:
                for byte in ANSWER:
                    if stop.wait(0.5):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        return

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        start = time.monotonic()
        r = probe(f"http://127.0.0.1:{srv.getsockname()[1]}/health", 1.5)
        took = time.monotonic() - start
        stop.set()
        t.join(5)
    assert (r.ok, r.error) == (False, "no answer within 1.5s")
    assert 1.4 < took < len(ANSWER) * 0.5  # ended by the deadline, long before the answer could be whole (18.5 s)
