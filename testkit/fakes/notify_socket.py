"""A NOTIFY_SOCKET stand-in: a datagram socket in a temp dir that records what arrives."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path


class NotifySocket:
    def __init__(self, directory: Path, name: str = "notify.sock", mode: int | None = None) -> None:
        self.path = str(directory / name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        if mode is not None:  # a sender that drops root (the front, docs/front.md) still reaches it, as systemd's
            os.chmod(self.path, mode)
        self.sock.settimeout(0.1)
        self.datagrams: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.datagrams.append((time.monotonic(), data.decode()))

    def messages(self) -> list[str]:
        return [d for _, d in self.datagrams]

    def fields(self) -> list[dict[str, str]]:
        return [dict(line.split("=", 1) for line in d.split("\n") if "=" in line) for d in self.messages()]

    def first(self, key: str, value: str | None = None) -> tuple[float, dict[str, str]] | None:
        for at, d in list(self.datagrams):  # a copy: the listener thread appends meanwhile
            f = dict(line.split("=", 1) for line in d.split("\n") if "=" in line)
            if key in f and (value is None or f[key] == value):
                return at, f
        return None

    def wait_first(self, key: str, value: str | None = None, timeout: float = 10.0) -> tuple[float, dict[str, str]]:
        """`first`, once the listener thread has read it: the supervisor's record of a notification (its journal
        line) can reach a test before this thread is scheduled to read the datagram (a busy machine)."""
        deadline = time.monotonic() + timeout
        while (found := self.first(key, value)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {key}={value} notification within {timeout} s: {self.messages()}")
            time.sleep(0.005)
        return found

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
