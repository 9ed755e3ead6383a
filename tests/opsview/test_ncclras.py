"""NCCL's RAS status in the incident file, from loopback servers the test runs.

`RasService` speaks the service side as NVIDIA/nccl has it at commit 5067397c2676d5aed50042fc39e5c8ee96eb0027:
src/ras/client_support.cc `rasClientEventLoop` (one command per '\\n'-ended line, matched case-insensitively:
"client protocol " -> "SERVER PROTOCOL 2\\n", "timeout N" -> "OK\\n", "verbose status" -> the report, then
`rasClientTerminate` closes the socket once the send queue is empty, so the client's end is EOF, as
src/ras/client.cc `getNCCLStatus` reads it) and src/ras/ras_internal.h (NCCL_RAS_CLIENT_PROTOCOL 2).  The
report's text is an excerpt of docs/userguide/source/troubleshooting/ras.rst there.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.opsview import forensics, ncclras
from kimi_supervisor.opsview.forensics import IncidentStore
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.lifecycle_world import HEALTH_LINE, serving_world
from testkit.fakes.log import RecordingLog
from tests.opsview.test_forensics import record

REPORT = """Job summary
===========

    Nodes  Processes         GPUs  Processes     GPUs
  (total)   per node  per process    (total)  (total)
        1          8            1          8        8

Communicators... (0.00s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         1         8         8         8   RUNNING      OK
"""


class RasService:
    """One loopback listener; `silent`: it accepts and never reads or answers (a RAS thread that hangs)."""

    def __init__(self, silent: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silent = silent
        self.commands: list[str] = []
        self.done = threading.Event()
        self.release = threading.Event()
        self.accepted = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.accepted.set()
        with conn:
            if self.silent:
                self.release.wait(60)
                return
            buffered = b""
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buffered += chunk
                while b"\n" in buffered:
                    raw, buffered = buffered.split(b"\n", 1)
                    cmd = raw.decode().rstrip("\r")
                    self.commands.append(cmd)
                    low = cmd.lower()
                    if low.startswith("client protocol "):
                        conn.sendall(b"SERVER PROTOCOL 2\n")
                    elif low.startswith("timeout "):
                        conn.sendall(b"OK\n")
                    elif low in ("status", "verbose status"):
                        # Sent in pieces, as the service's send queue does; then closed: the end of the report.
                        data = REPORT.encode()
                        for i in range(0, len(data), 100):
                            conn.sendall(data[i : i + 100])
                        self.done.set()
                        return
                    else:
                        conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())

    def close(self) -> None:
        self.release.set()
        self.listener.close()


@pytest.fixture
def service() -> Iterator[RasService]:
    s = RasService()
    yield s
    s.close()


@pytest.fixture
def silent() -> Iterator[RasService]:
    s = RasService(silent=True)
    yield s
    s.close()


def test_the_incident_has_the_report_asked_as_ncclras_asks(tmp_path: Path, service: RasService) -> None:
    log = RecordingLog()
    path = record(IncidentStore(tmp_path / "i"), None, [(1, "api")], log, ras=("127.0.0.1", service.port))
    ras = json.loads(Path(path).read_text())["nccl_ras"]
    assert (ras["address"], ras["text"], ras["note"]) == (f"127.0.0.1:{service.port}", REPORT, None)
    assert service.commands == ["CLIENT PROTOCOL 2", "TIMEOUT 1", "VERBOSE STATUS"]
    assert log.events("incident.saved")[0]["nccl_ras"] == f"report from 127.0.0.1:{service.port}"


def test_no_listener_is_one_line_in_the_file_never_a_failure(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    # closed: nothing listens there (a child with no NCCL communicator yet, NCCL < 2.24, NCCL_RAS_ENABLE=0)
    log = RecordingLog()
    path = record(IncidentStore(tmp_path / "i"), None, [(1, "api")], log, ras=("127.0.0.1", port))
    doc = json.loads(Path(path).read_text())
    assert doc["nccl_ras"]["text"] is None
    assert doc["nccl_ras"]["note"] == f"no RAS listener at 127.0.0.1:{port} (connection refused)"
    assert doc["exit_code"] == 17 and doc["gpus"][0]["index"] == 0  # the rest of the incident as ever


class HangsUntilAsked:
    """Answers for one PID at once; for the other it hangs until the RAS service has a connection (a py-spy stuck
    on a process in D state, the RAS query beside it).  One after the other, nothing is asked while it hangs: it
    hangs out the capture's budget and its dump is recorded as missing."""

    def __init__(self, hangs: int, asked: threading.Event) -> None:
        self.hangs = hangs
        self.asked = asked

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]:
        if pid == self.hangs:
            self.asked.wait(60)
            return "asked beside", None
        return f"Thread {pid}: busy_loop", None


def test_a_service_that_never_answers_is_asked_beside_a_hanging_dump_within_the_budget(
    tmp_path: Path, silent: RasService
) -> None:
    """The RAS query runs beside the dumps, so the stop waits for the longer of the two, not their sum.

    By cause, not by the capture's duration (was `took < budget + bound`, this machine's speed): the hanging dump
    ends only once the RAS service has a connection, so its answer in the file proves the two overlapped; one after
    the other it would hang out the budget.  The capture's delay is bench row 3's."""
    dumper = HangsUntilAsked(hangs=2, asked=silent.accepted)
    budget = 30.0  # stops a hung test; only a capture that never asks while dumping waits it out
    try:
        path = record(
            IncidentStore(tmp_path / "i"),
            dumper,
            [(1, "api"), (2, "EngineCore")],
            RecordingLog(),
            budget_s=budget,
            ras=("127.0.0.1", silent.port),
        )
    finally:
        silent.accepted.set()
    doc = json.loads(Path(path).read_text())
    # Answered in time: the RAS service had its connection while the dump hung (one after the other: None).
    assert [d["text"] for d in doc["stacks"]] == ["Thread 1: busy_loop", "asked beside"]
    assert doc["nccl_ras"]["text"] is None
    bound = min(forensics.RAS_S, forensics.RAS_SHARE * budget)
    assert doc["nccl_ras"]["note"] == f"no answer to the protocol handshake within {bound:g}s"
    assert doc["nccl_ras"]["seconds"] >= 0.99 * bound  # it waited out its own bound (a lower bound: any machine)


def test_a_report_cut_by_the_bound_is_kept_with_a_note() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    release = threading.Event()

    def half_report() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"SERVER PROTOCOL 2\n")
            conn.recv(4096)
            conn.sendall(b"OK\n")
            conn.recv(4096)
            conn.sendall(REPORT.encode()[:40])  # then NCCL waits on its peers, past our bound
            release.wait(60)

    threading.Thread(target=half_report, daemon=True).start()
    try:
        status = ncclras.query("127.0.0.1", listener.getsockname()[1], 1.0)
    finally:
        release.set()
        listener.close()
    assert status.text == REPORT[:40] and status.note == "no answer to the report within 1s"


def test_an_unhealthy_stop_asks_the_childs_nccl_ras_addr(tmp_path: Path, service: RasService) -> None:
    """The supervisor asks where its child's NCCL listens: child.env's NCCL_RAS_ADDR (config/gpu_pinning.py)."""
    env = {"NCCL_RAS_ADDR": f"127.0.0.1:{service.port}"}
    w = serving_world(tmp_path, preflight={"gpus": [0]}, child={"env": env}, probe=FakeGpuProbe([FakeGpu()]))
    w.health = lambda t: 200 if 1.0 <= t < 3.0 else (None if t < 1.0 else 500)
    w.say_at(2.0, HEALTH_LINE)
    assert w.run() == ExitCode.CHILD_UNHEALTHY
    doc = json.loads(Path(str(w.events("incident.saved")[0]["path"])).read_text())
    assert doc["nccl_ras"]["text"] == REPORT and service.commands[-1] == "VERBOSE STATUS"
