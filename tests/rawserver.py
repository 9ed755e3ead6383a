"""A loopback server that answers every connection with scripted raw bytes, at a scripted pace.

For HTTP clients under abuse: a status line trickled one byte at a time, a body that never ends, a
100k-deep JSON document.  `stop()` (or leaving the block) ends every pending answer at once: the pace
is an `Event.wait`, so the test never waits on a trickle it no longer needs.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class RawServer:
    def __init__(self, head: bytes, body: bytes = b"", head_byte_s: float = 0.0, body_byte_s: float = 0.0) -> None:
        self.head, self.body = head, body
        self.head_byte_s, self.body_byte_s = head_byte_s, body_byte_s
        self.connections = 0
        self.accepted = threading.Event()
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)  # a blocked accept() is not woken by close(): look at the stop flag often
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self.accepted.set()
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request: its content does not matter here
            for data, pace in ((self.head, self.head_byte_s), (self.body, self.body_byte_s)):
                if pace <= 0:
                    conn.sendall(data)
                    continue
                for i in range(len(data)):
                    if self._stop.wait(pace):
                        return
                    conn.sendall(data[i : i + 1])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@contextlib.contextmanager
def raw_server(
    head: bytes, body: bytes = b"", head_byte_s: float = 0.0, body_byte_s: float = 0.0
) -> Iterator[RawServer]:
    server = RawServer(head, body, head_byte_s, body_byte_s)
    try:
        yield server
    finally:
        server.stop()


def answer(status: str, body: bytes, content_type: str = "application/json") -> tuple[bytes, bytes]:
    """(head, body) of an HTTP/1.1 answer with a Content-Length."""
    head = (
        f"HTTP/1.1 {status}\r\nserver: uvicorn\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode(), body
