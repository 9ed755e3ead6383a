"""A NOTIFY_SOCKET stand-in: a datagram socket in a temp dir that records what arrives."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


class NotifySocket:
    def __init__(self, directory: Path, name: str = "notify.sock") -> None:
        self.path = str(directory / name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
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
        for (at, _), f in zip(self.datagrams, self.fields(), strict=True):
            if key in f and (value is None or f[key] == value):
                return at, f
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
