"""Quick checks that testkit/fakes/fake_vllm.py behaves like `vllm serve`."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from testkit.fakes.fake_vllm_output import FIXTURES, as_own, excerpt, identify
from testkit.fakes.fake_vllm_proc import P
from testkit.procutil import free_port, proc_stat
from tests.conftest import wait_for

FAKE = Path(__file__).resolve().parents[2] / "testkit" / "fakes" / "fake_vllm.py"


class Fake:
    """A running fake in its own session/process group, output in files."""

    def __init__(self, tmp: Path, *extra: str, tp: int = 2) -> None:
        self.port = free_port()
        self.out_path = tmp / "stdout.log"
        self.err_path = tmp / "stderr.log"
        argv = [
            sys.executable,
            str(FAKE),
            "serve",
            str(tmp / "model"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp),
            # real vLLM flags the fake must accept and ignore
            "--max-model-len",
            "4096",
            "--gpu-memory-utilization",
            "0.95",
            "--dtype",
            "bfloat16",
            "--trust-remote-code",
            "--max-lifetime",
            "60",
            *extra,
        ]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pgid = self.proc.pid

    @property
    def stdout(self) -> str:
        return self.out_path.read_bytes().decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_bytes().decode("utf-8", "replace")

    def get(self, path: str, timeout: float = 2.0, body: dict[str, object] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is None:
                conn.request("GET", path)
            else:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_healthy(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.stderr
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=1.0)[0] == 200:
                    return
            time.sleep(0.05)
        raise AssertionError("fake never became healthy")

    def group_alive(self) -> bool:
        """Any live (non-zombie) process still in the group we started?"""
        return bool(group_members(self.pgid))

    def wait_group_gone(self, timeout: float = 3.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.proc.poll()
            if not self.group_alive():
                return True
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[list[Fake]]:
    started: list[Fake] = []
    try:
        yield started
    finally:
        for fake in started:
            fake.kill()


def start(fakes: list[Fake], tmp: Path, *extra: str, tp: int = 2) -> Fake:
    fake = Fake(tmp, *extra, tp=tp)
    fakes.append(fake)
    return fake


def group_members(pgid: int) -> list[int]:
    """Non-zombie processes of process group `pgid` (zombies wait for init)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields and int(fields[2]) == pgid and fields[0] != b"Z":
                found.append(int(entry))
    return found


def descendants(root: int) -> dict[int, str]:
    """pid -> psutil's name() of every descendant (the full title, from the cmdline)."""
    out: dict[int, str] = {}
    for child in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out[child.pid] = child.name()
    return out


def test_normal_lifecycle(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "1.0")
    with pytest.raises(ConnectionRefusedError):
        fake.get("/health")
    fake.wait_healthy()
    assert f"Starting vLLM server on http://127.0.0.1:{fake.port}" in fake.stdout
    assert f"'port': {fake.port}" in fake.stdout and str(tmp_path / "model") in fake.stdout
    assert "INFO:     Application startup complete." in fake.stderr
    assert "Loading safetensors checkpoint shards: 100% Completed" in fake.stderr

    status, body = fake.get("/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == str(tmp_path / "model")

    names = sorted(descendants(fake.proc.pid).values())
    # comm keeps 15 bytes; psutil recovers the full title from the cmdline
    assert names in (
        ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"],
        ["VLLM::EngineCor", "VLLM::Worker_TP", "VLLM::Worker_TP"],
    )

    fake.proc.send_signal(signal.SIGTERM)
    assert fake.proc.wait(timeout=3) == 0
    assert fake.wait_group_gone(), "processes left behind after SIGTERM"
    assert "[shutdown] API server: shutting down FastAPI HTTP server" in fake.stdout
    assert "INFO:     Application shutdown complete." in fake.stderr


def test_ignore_sigterm_needs_sigkill(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.3", "--ignore-sigterm")
    fake.wait_healthy()
    tree = descendants(fake.proc.pid)
    assert len(tree) == 3
    os.killpg(fake.pgid, signal.SIGTERM)
    time.sleep(0.5)
    assert fake.proc.poll() is None
    assert descendants(fake.proc.pid).keys() == tree.keys()
    assert fake.get("/health")[0] == 200
    os.killpg(fake.pgid, signal.SIGKILL)
    assert fake.proc.wait(timeout=3) == -signal.SIGKILL
    assert fake.wait_group_gone()


def test_crash_during_load(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.4", "--crash-during-load")
    assert fake.proc.wait(timeout=10) == 1
    assert fake.stderr.rstrip().endswith(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
    )
    assert "torch.OutOfMemoryError: CUDA out of memory." in fake.stdout
    assert "EngineCore failed to start." in fake.stdout
    assert fake.wait_group_gone()


def test_free_memory_error(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--free-memory-error", tp=1)
    assert fake.proc.wait(timeout=10) == 1
    assert (
        "ValueError: Free memory on device (12.34/139.81 GiB) on startup is less "
        "than desired GPU memory utilization (0.95, 132.82 GiB)." in fake.stdout
    )
    assert "Engine core initialization failed" in fake.stderr


def test_worker_death_exits_zero(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(
        fakes, tmp_path, "--load-seconds", "0.3", "--kill-worker-after-ready", "0.2", "--engine-death-exit-delay", "0.3"
    )
    fake.wait_healthy()
    assert fake.proc.wait(timeout=5) == 0
    out = fake.stdout
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor." in out
    assert "EngineCore encountered a fatal error." in out
    assert "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue." in out
    assert "INFO:     Finished server process" in fake.stderr
    assert fake.wait_group_gone()


def test_hang_after_ready(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.3", "--hang-after-ready", "0.3", tp=1)
    fake.wait_healthy()
    time.sleep(0.4)
    with pytest.raises(TimeoutError):
        fake.get("/health", timeout=0.5)
    assert fake.proc.poll() is None


def test_sigterm_during_load(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "3")
    # Its first line comes after its handlers are in place (a fixed sleep lost that race on a busy machine).
    wait_for(lambda: fake.stdout or fake.stderr)
    os.killpg(fake.pgid, signal.SIGTERM)
    assert fake.proc.wait(timeout=5) == -signal.SIGINT
    assert "KeyboardInterrupt: terminated" in fake.stderr
    assert fake.wait_group_gone()


def test_flood_only(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(FAKE),
            "serve",
            "m",
            "--flood-only",
            "--flood-lines",
            "20000",
            "--flood-line-bytes",
            "100",
        ],
        capture_output=True,
        timeout=20,
        check=True,
    ).stdout
    lines = out.split(b"\n")
    assert lines[-1] == b""
    assert len(lines) == 20001
    assert all(len(line) == 99 for line in lines[:-1])
    assert b"flood line 000019999 " in lines[-2]


def test_completions_answer_the_served_model_and_fail_once_the_engine_is_dead(
    fakes: list[Fake], tmp_path: Path
) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.3", "--kill-worker-after-ready", "1", tp=1)
    fake.wait_healthy()
    model = str(tmp_path / "model")
    status, body = fake.get("/v1/completions", body={"model": model, "prompt": "hi there", "max_tokens": 3})
    assert status == 200
    reply = json.loads(body)
    assert reply["model"] == model and reply["choices"][0]["text"] == " ok ok ok"
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert fake.get("/v1/completions", body={"model": "other", "prompt": "x"})[0] == 404
    assert fake.get("/v1/completions")[0] == 405  # GET
    end = time.monotonic() + 5
    while fake.get("/health")[0] == 200 and time.monotonic() < end:
        time.sleep(0.05)
    status, body = fake.get("/v1/completions", body={"prompt": "x"})
    assert status == 500 and json.loads(body)["error"]["type"] == "InternalServerError"
    assert '"POST /v1/completions HTTP/1.1" 200 OK' in fake.stdout  # uvicorn's access line


def test_excerpts_are_cut_from_the_fixtures_by_marker() -> None:
    lines = excerpt("worker_killed.log", "died unexpectedly", "RuntimeError: Executor failed.", labels=("EngineCore",))
    assert "Worker proc VllmWorker-0 died unexpectedly" in lines[0]
    assert lines[-1].endswith("RuntimeError: Executor failed.")
    assert all(line.startswith("(EngineCore pid=566) ") for line in lines)
    raw = (FIXTURES / "worker_killed.log").read_bytes().decode()  # CRs kept
    assert all(line in raw for line in lines)
    with pytest.raises(LookupError):
        excerpt("worker_killed.log", "no such marker", "x")


def test_a_replayed_line_is_this_processs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "label", "Worker_TP1")
    monkeypatch.setattr(P, "pid", 4242)
    identify("/models/kimi", "http://127.0.0.1:9000", 9000)
    fd, text = as_own(
        "(Worker pid=2181) ERROR 11-29 17:10:10 [multiproc_executor.py:953] Starting to load model "
        "/tmp/kimi-e2e/tiny-llama... on http://127.0.0.1:18000"
    )
    assert fd == 1
    assert text.startswith("(Worker_TP1 pid=4242) ERROR ") and "11-29 17:10:10" not in text
    assert text.endswith("[multiproc_executor.py:953] Starting to load model /models/kimi... on http://127.0.0.1:9000")
    assert as_own("INFO:     Finished server process [487]") == (2, "INFO:     Finished server process [4242]")
    assert as_own("Traceback (most recent call last):")[0] == 2


def test_access_log_every_request_like_uvicorn(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.3", tp=1)
    fake.wait_healthy()
    assert fake.get("/Application%20startup%20complete.")[0] == 404
    assert fake.get("/EngineDeadError?x=1")[0] == 404
    time.sleep(0.2)
    lines = [line for line in fake.stdout.splitlines() if line.startswith("INFO:     127.0.0.1:")]
    assert any(line.endswith('"GET /health HTTP/1.1" 200 OK') for line in lines)
    # uvicorn quotes the decoded path and keeps the query as sent
    assert any('"GET /Application%20startup%20complete. HTTP/1.1" 404 Not Found' in line for line in lines)
    assert any('"GET /EngineDeadError?x=1 HTTP/1.1" 404 Not Found' in line for line in lines)


def test_trickle_health_after(fakes: list[Fake], tmp_path: Path) -> None:
    fake = start(fakes, tmp_path, "--load-seconds", "0.3", "--trickle-health-after", "0.2", tp=1)
    fake.wait_healthy()
    time.sleep(0.4)
    with socket.create_connection(("127.0.0.1", fake.port), timeout=2) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start_at = time.monotonic()
        first = s.recv(100)
        second = s.recv(100)
        took = time.monotonic() - start_at
    # One byte a read, the second at least 0.5 s after the first: a trickle (an upper bound would time the machine).
    assert first == b"H" and second == b"T" and took > 0.8
