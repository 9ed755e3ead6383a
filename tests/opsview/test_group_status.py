"""The status endpoint a group node serves its peers: GET only, a fixed small document, nothing else."""

from __future__ import annotations

import json
import socket

from kimi_supervisor.liveness.http import request
from kimi_supervisor.liveness.peers import NetGroupProbe
from kimi_supervisor.opsview.group_status import CONNECTION_TIMEOUT_S, GroupStatus, StatusServer
from testkit.fakes.clock import RecordingLog


def serving() -> tuple[GroupStatus, StatusServer, str]:
    status = GroupStatus("follower", 1, "kimi", "ab" * 32)
    server = StatusServer(status, "127.0.0.1", 0, RecordingLog())
    server.start()
    return status, server, f"http://127.0.0.1:{server.bound_port}/"


def test_get_answers_the_document_and_follows_the_run() -> None:
    status, server, url = serving()
    try:
        answer = request("GET", url, 2.0)
        assert answer.status == 200 and len(answer.body) < 400
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
            assert answer.status == 405, method
        assert request("GET", url + "kill?pid=1", 2.0).status == 404
        assert status.state == "preflight" and status.run_id == ""  # nothing a client sent changed anything
        assert request("GET", url + "x" * 5000, 2.0).status == 414
        # A client that connects and sends nothing holds the server for at most its connection timeout.
        idle = socket.create_connection(("127.0.0.1", server.bound_port))
        try:
            answer = request("GET", url, CONNECTION_TIMEOUT_S + 2.0)
            assert answer.status == 200
        finally:
            idle.close()
    finally:
        server.stop()
