"""gpuaccept/weights_common.py, holder_standin.py and engine_standin.py (docs/weight-holder.md) on CPU: the
checksum, the restart-time split, the handle messages, and both stand-ins end to end with WEIGHTS_FAKE=1 (the
"tensor" is the file's bytes).  The CUDA IPC path needs torch and a GPU: its test skips, saying why, without them;
bench/results/weights_holder_h200.md records it on the H200."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpuaccept import weights_common
from gpuaccept.weights_common import (
    add_checksum,
    connect,
    int32_sum,
    md_table,
    rank_socket,
    read_meta,
    recv_msg,
    send_msg,
    supervisor_share,
    write_meta,
)
from testkit.fakes.clock import FakeClock
from testkit.harness import short_link
from testkit.procutil import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM = REPO / "gpuaccept" / "weights_bin" / "vllm"


def test_the_checksum_of_chunks_adds_up_to_the_checksum_of_the_whole() -> None:
    data = os.urandom(1 << 16)
    whole = int32_sum(data)
    parts = 0
    for off in range(0, len(data), 4096):
        parts = add_checksum(parts, int32_sum(data[off : off + 4096]))
    assert parts == whole
    assert int32_sum(b"\xff\xff\xff\xff" * 2) == (1 << 64) - 2  # -1 + -1, wrapped as torch's int64 sum wraps
    assert int32_sum(data[:-4] + bytes(4)) != whole or data[-4:] == bytes(4)


def test_the_restart_splits_into_the_supervisors_share_and_the_engines() -> None:
    row = supervisor_share(crash=10.0, spawn=10.3, health_200=25.3, ready=25.4)
    assert row["crash_to_spawn_s"] == pytest.approx(0.3)
    assert row["health_to_ready_s"] == pytest.approx(0.1)
    assert row["supervisor_share_s"] == pytest.approx(0.4)
    assert row["engine_s"] == pytest.approx(15.0)
    assert row["crash_to_ready_s"] == pytest.approx(15.4)
    with pytest.raises(ValueError, match="out of order"):
        supervisor_share(crash=10.0, spawn=9.0, health_200=12.0, ready=13.0)


def test_messages_cross_a_socket_whole_and_a_closed_peer_is_an_error() -> None:
    a, b = socket.socketpair()
    payload = {"rank": 0, "blob": os.urandom(300_000)}
    sender = threading.Thread(target=send_msg, args=(a, payload))
    sender.start()
    assert recv_msg(b) == payload
    sender.join(5)
    a.close()
    with pytest.raises(ConnectionError, match="closed after 0 of 8 bytes"):
        recv_msg(b)
    b.close()


def test_connect_gives_up_at_its_deadline_on_a_missing_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTS_FAKE", "1")  # the socket's name from a fake GPU's uuid, without torch
    clock = FakeClock()  # the retry loop's time: it passes only when the loop sleeps
    monkeypatch.setattr(weights_common, "time", clock)
    with pytest.raises(FileNotFoundError):
        connect(rank_socket(short_link(tmp_path), 0), 0.2)
    # It retried until its own deadline, then gave up: was `< 5 s` of wall time, a speed.
    assert 0.2 <= clock.t <= 0.25 + 1e-9, clock.t  # the deadline, past it by one retry at most


def test_markdown_cells_are_escaped() -> None:
    out = md_table(["a", "b"], [[1.23456, "x|y\nz"]])
    assert out.splitlines() == ["| a | b |", "| --- | --- |", "| 1.235 | x\\|y z |"]


def _line(proc: subprocess.Popen[bytes], needle: str, timeout: float) -> str:
    """The first stdout line of PROC holding NEEDLE, within TIMEOUT (a reader thread: no select on a buffered
    pipe, whose readline may already hold the next lines)."""
    lines = _LINES.setdefault(proc.pid, queue.Queue())
    if proc.pid not in _READERS:
        assert proc.stdout is not None
        stream = proc.stdout

        def pump() -> None:
            for raw in stream:
                lines.put(raw.decode())

        _READERS[proc.pid] = threading.Thread(target=pump, daemon=True)
        _READERS[proc.pid].start()
    end = time.monotonic() + timeout
    seen = []
    while (left := end - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no {needle!r} within {timeout}s: {seen[-5:]}")


_LINES: dict[int, queue.Queue[str]] = {}
_READERS: dict[int, threading.Thread] = {}


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return err.code


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(VLLM), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(20)


def test_the_holder_serves_its_bytes_and_the_engine_maps_and_checks_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTS_FAKE", "1")
    model = tmp_path / "model"
    model.mkdir()
    data = os.urandom(1 << 20)
    (model / "weights.bin").write_bytes(data)
    write_meta(model, len(data), int32_sum(data))
    assert read_meta(model) == {"bytes": len(data), "checksum": int32_sum(data)}
    sockets, hport, eport = short_link(tmp_path / "sockets"), free_port(), free_port()  # vLLM's names fit in it
    env = {**os.environ, "WEIGHTS_FAKE": "1", "PYTHONUNBUFFERED": "1", "WEIGHTS_BENCH_DIR": str(tmp_path)}
    holder_args = ["preload", "--model", str(model), "-tp", "1", "--weight-cache-socket-dir", str(sockets)]
    holder_args += ["--weight-cache-health-port", str(hport), "--weight-cache-health-host", "127.0.0.1"]
    holder = _start(holder_args, env)
    engine = None
    try:
        ready = _line(holder, "Weight cache daemon READY", 30)
        assert f"node 0/1 serving 1 local rank(s) x 1 role(s) in {sockets} =====" in ready
        assert _health(hport) == 200
        extra = f'{{"socket_dir": "{sockets}", "fallback": false}}'
        engine = _start(["serve", str(model), "--port", str(eport), "--load-format", "ipc_cache",
                         "--model-loader-extra-config", extra], env)  # fmt: skip
        _line(engine, "Application startup complete.", 30)
        assert _health(eport) == 200
        assert _stop(engine) == 0
        assert holder.poll() is None and _health(hport) == 200  # the engine's stop leaves the holder serving
    finally:
        if engine is not None:
            _stop(engine)
        # vLLM's parent exits max(rank exit codes) = -15 after a SIGTERM (preload.py:337): status 241.
        assert _stop(holder) == 241
    # The ranks died of the signal: serve_forever's cleanup never ran, the socket stays (daemon.py:382-386).
    assert [p.name for p in sockets.iterdir()] == [os.path.basename(rank_socket(sockets, 0))]


def test_an_engine_with_fallback_off_and_no_holder_fails_naming_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write_meta(model, 0, 0)
    extra = f'{{"socket_dir": "{tmp_path / "none"}", "fallback": false}}'
    env = {**os.environ, "WEIGHTS_FAKE": "1"}
    out = subprocess.run(
        [sys.executable, str(VLLM), "serve", str(model), "--port", str(free_port()), "--load-format", "ipc_cache",
         "--model-loader-extra-config", extra],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert "ipc_cache: no weight cache daemon for rank 0" in out.stderr and "fallback is off" in out.stderr


def test_a_real_load_to_the_gpu_sums_what_the_file_holds(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed here (the CI's env); the H200 run covers it")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here; bench/results/weights_holder_h200.md covers the GPU path")
    from gpuaccept.weights_common import gpu_checksum, load_to_gpu

    data = os.urandom(3 << 20)
    (tmp_path / "w.bin").write_bytes(data)
    tensor, res = load_to_gpu(tmp_path / "w.bin", 0)
    assert res.nbytes == len(data) and res.checksum == int32_sum(data) == gpu_checksum(tensor)


# Runs the holder stand-in with every SIGTERM handler wrapped so that each function it calls first gets a second
# SIGTERM: `signal.raise_signal` runs the handler again at once, at that very point (PyErr_CheckSignals), as a
# second signal landing there would.  The profile function runs untraced, so a nested run raises nothing itself;
# it is on only while the handler runs, so the test's own SIGTERM never lands inside it (where nothing is traced).
REENTERED = r"""
import signal, sys
sys.path.insert(0, sys.argv[1])
from gpuaccept import holder_standin

inside, real_signal = [], signal.signal

def wrapped(signum, handler):
    if signum != signal.SIGTERM or not callable(handler):
        return real_signal(signum, handler)

    def run(*args):
        inside.append(True)
        sys.setprofile(second_sigterm)
        try:
            handler(*args)
        finally:
            inside.pop()
            if not inside:
                sys.setprofile(None)

    return real_signal(signum, run)

def second_sigterm(frame, event, arg):
    if inside and event in ("call", "c_call"):
        signal.raise_signal(signal.SIGTERM)

signal.signal = wrapped
sys.exit(holder_standin.main(sys.argv[2:]))
"""


def test_the_holder_stops_when_a_second_sigterm_lands_inside_its_handler(tmp_path: Path) -> None:
    """The supervisor SIGTERMs the process group and each member (lifecycle/stopping.py), so the holder's parent
    gets two, and the second may land while the first one's handler runs.  vLLM's handler (preload.py `_shutdown`)
    takes no lock; the stand-in's took one (`threading.Event.set`), and the second run, inside the first, waited
    for it forever: the H200 run's holder stop of 30.14 s, SIGKILL at the grace (bench/results/reactor_h200.md;
    on CPU 1 stop in 40-60 timed at random).  Here the second SIGTERM lands at every call the handler makes."""
    model = tmp_path / "model"
    model.mkdir()
    data = os.urandom(1 << 16)
    (model / "weights.bin").write_bytes(data)
    write_meta(model, len(data), int32_sum(data))
    sockets, hport = short_link(tmp_path / "sockets"), free_port()
    env = {**os.environ, "WEIGHTS_FAKE": "1", "PYTHONUNBUFFERED": "1", "WEIGHTS_BENCH_DIR": str(tmp_path)}
    args = ["--model", str(model), "-tp", "2", "--weight-cache-socket-dir", str(sockets)]
    args += ["--weight-cache-health-port", str(hport), "--weight-cache-health-host", "127.0.0.1"]
    holder = subprocess.Popen(
        [sys.executable, "-c", REENTERED, str(REPO), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        _line(holder, "Weight cache daemon READY", 30)
        assert _health(hport) == 200
        holder.send_signal(signal.SIGTERM)
        # As after one SIGTERM: the ranks terminated, the parent exits max(their exit codes) = -15, status 241.
        assert holder.wait(20) == 241
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
