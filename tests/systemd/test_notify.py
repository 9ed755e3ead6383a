"""sd_notify: exact datagrams to a real socket; silent without one; watchdog ownership."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.systemd.notify import NullNotifier, SdNotifier, notifier_from_env, watchdog_interval
from testkit.fakes.notify_socket import NotifySocket
from tests.conftest import wait_for


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", sock.path)
    yield sock
    sock.close()


def test_datagrams_in_order(notify_socket: NotifySocket) -> None:
    n = notifier_from_env()
    assert isinstance(n, SdNotifier)
    n.send(STATUS="loading weights 68/119 (57%), 4m12s")
    n.send(READY=1, STATUS="ready")
    n.send(WATCHDOG=1)
    wait_for(lambda: len(notify_socket.messages()) == 3)
    assert notify_socket.messages() == [
        "STATUS=loading weights 68/119 (57%), 4m12s",
        "READY=1\nSTATUS=ready",
        "WATCHDOG=1",
    ]


def test_status_newlines_cannot_inject_fields(notify_socket: NotifySocket) -> None:
    notifier_from_env().send(STATUS="line one\nREADY=1")
    wait_for(lambda: notify_socket.messages())
    assert notify_socket.messages() == ["STATUS=line one READY=1"]


def test_without_socket_nothing_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = notifier_from_env()
    assert isinstance(n, NullNotifier)
    n.send(READY=1)


def test_socket_gone_does_not_raise(tmp_path: Path) -> None:
    n = notifier_from_env({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    n.send(STATUS="x")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "junk"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected


@pytest.mark.parametrize("status", ["loading weights – 68/119", "✗ /health failed", "bad byte \ufffd in a line"])
def test_non_latin1_status_is_sent_as_utf8(notify_socket: NotifySocket, status: str) -> None:
    """sdnotify 0.3.2 encoded Latin-1 and dropped the whole datagram (READY=1 with it) on these."""
    notifier_from_env().send(READY=1, STATUS=status)
    wait_for(lambda: notify_socket.messages())
    assert notify_socket.messages() == [f"READY=1\nSTATUS={status}"]


def test_abstract_namespace_socket() -> None:
    import socket

    name = f"kimi-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        notifier_from_env({"NOTIFY_SOCKET": "@" + name}).send(WATCHDOG=1, STATUS="✓")
        assert sock.recv(4096).decode() == "WATCHDOG=1\nSTATUS=✓"


def test_failure_is_logged_once_then_recovery_counts_the_lost(tmp_path: Path) -> None:
    from testkit.fakes.log import RecordingLog

    log = RecordingLog()
    path = tmp_path / "late.sock"
    n = notifier_from_env({"NOTIFY_SOCKET": str(path)}, log=log)
    for _ in range(3):
        n.send(STATUS="x")
    assert [e[1] for e in log.records] == ["notify.failed"]  # once, not three times
    sock = NotifySocket(tmp_path, name="late.sock")
    try:
        n.send(READY=1)
        wait_for(lambda: sock.messages())
        assert sock.messages() == ["READY=1"]
        assert [e[1] for e in log.records] == ["notify.failed", "notify.recovered"]
        assert log.events("notify.recovered")[0]["lost"] == 3
    finally:
        sock.close()
