"""The one HTTP client: `/health`, the canary and `/metrics` all go through `request`.

Each request has one monotonic deadline for all of it: connect, TLS, the request, the status line, the
headers and the body.  Every recv gets only what is left of it as its socket timeout, so a server that
trickles one byte every 0.9 s cannot hold a thread past the deadline the way a per-read timeout lets it.
The body is capped.  Nothing a server sends raises out of `request` or untrusted_json.parse_json: a refused connection,
a timeout, a bad status line, a bad chunk, a huge or 100k-deep JSON document are all an `Answer` with a
one-line `error`, so the thread that asked counts a failure and goes on.

It speaks just enough HTTP/1.1 for vLLM's uvicorn: `Connection: close`, then `Content-Length`, chunked,
or read-to-close bodies.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import ssl
import time
import urllib.parse
from collections.abc import Mapping
from typing import Protocol

from kimi_supervisor.config.vllm_args import UNIX_SCHEME
from kimi_supervisor.quoting import escape_unprintable

MAX_HEAD = 64 * 1024  # a status line and headers longer than this are not an answer
MAX_BODY = 4 << 20  # a /metrics page is tens of KiB, a canary answer < 1 KiB: never buffer an unbounded one
RECV = 65536


@dataclasses.dataclass(frozen=True)
class Answer:
    """What one request got: `error` None means a complete answer (whatever its http_status)."""

    http_status: int | None  # None: no status line arrived
    body: bytes
    error: str | None  # one line
    at: float  # monotonic time the request ended
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


class HttpClient(Protocol):
    """One HTTP request within `timeout_s` in all, never raising for what a server does (httpget.request).

    `/health` (HealthProber), the canary and `/metrics` (DeepLiveness, Drain) take one; tests pass a fake.
    """

    def __call__(
        self,
        method: str,
        url: str,
        timeout_s: float,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        max_body: int = ...,
    ) -> Answer: ...


class _Failed(Exception):
    """A reason the request cannot give a complete answer; `http_status` once the status line was read."""

    def __init__(self, reason: str, http_status: int | None = None) -> None:
        super().__init__(reason)
        self.http_status = http_status


def request(
    method: str,
    url: str,
    timeout_s: float,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    max_body: int = MAX_BODY,
) -> Answer:
    """`method url` within `timeout_s` in all; never raises for anything the network or the server does."""
    start = time.monotonic()
    deadline = start + timeout_s
    http_status: int | None = None
    sock: socket.socket | None = None
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == UNIX_SCHEME:  # vLLM's --uds: the host is the socket's percent-encoded path
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(_left(deadline))
            sock.connect(urllib.parse.unquote(parts.netloc))
        else:
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if parts.scheme == "https" else 80)
            sock = socket.create_connection((host, port), timeout=_left(deadline))
        if parts.scheme == "https":
            sock.settimeout(_left(deadline))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        sock.settimeout(_left(deadline))
        sock.sendall(_request_bytes(method, parts, body, headers))
        reader = _Reader(sock, deadline)
        head = reader.head()
        http_status, fields = _parse_head(head)
        try:
            data = reader.body(fields, max_body, no_body=method == "HEAD" or http_status in (204, 304))
        except TimeoutError:
            raise _Failed(f"no complete answer within {timeout_s:g}s", http_status) from None
        end = time.monotonic()
        return Answer(http_status, data, None, end, end - start)
    except _Failed as exc:
        return _failed(start, exc.http_status if exc.http_status is not None else http_status, str(exc))
    except ConnectionRefusedError:
        return _failed(start, None, "connection refused")
    except TimeoutError:
        return _failed(start, http_status, f"no answer within {timeout_s:g}s")
    except (OSError, ValueError, UnicodeError) as exc:
        return _failed(start, http_status, one_line(f"{type(exc).__name__}: {exc}"))
    finally:
        if sock is not None:
            sock.close()


def one_line(text: str, limit: int = 300) -> str:
    """A reason fit for one log field and one STATUS= line: unprintable characters escaped, length capped."""
    return escape_unprintable(text[: limit * 2])[:limit]


def finite_count(name: str, value: float) -> float:
    """A count (requests, tokens) must be a finite number >= 0; ValueError naming it otherwise."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} is {value!r}: not a count")
    return value


def _failed(start: float, http_status: int | None, reason: str) -> Answer:
    end = time.monotonic()
    return Answer(http_status, b"", reason, end, end - start)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _request_bytes(
    method: str, parts: urllib.parse.SplitResult, body: bytes | None, headers: Mapping[str, str] | None
) -> bytes:
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = "localhost" if parts.scheme == UNIX_SCHEME else parts.netloc
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close"]
    fields = {"User-Agent": "kimi-supervisor", **(headers or {})}
    if body is not None:
        fields["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + (body or b"")


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/") or len(code) != 3 or not code.isdigit():
        raise _Failed(f"not an HTTP status line: {one_line(repr(lines[0][:80]))}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return int(code), fields


class _Reader:
    """Reads one response off `sock`, every recv bounded by what is left of `deadline`."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = b""
        self._eof = False

    def _more(self) -> bool:
        """Read once more; False at the end of the stream."""
        if self._eof:
            return False
        self._sock.settimeout(_left(self._deadline))
        chunk = self._sock.recv(RECV)
        if not chunk:
            self._eof = True
            return False
        self._buf += chunk
        return True

    def head(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                head, self._buf = self._buf[:end], self._buf[end + 4 :]
                return head
            if len(self._buf) > MAX_HEAD:
                raise _Failed(f"response headers longer than {MAX_HEAD} bytes")
            if not self._more():
                raise _Failed("connection closed before the response headers ended")

    def body(self, fields: Mapping[str, str], cap: int, no_body: bool) -> bytes:
        if no_body:
            return b""
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return self._chunked(cap)
        length = fields.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _Failed(f"bad Content-Length: {one_line(repr(length[:40]))}")
            n = int(length)
            if n > cap:
                raise _Failed(f"answer larger than {cap} bytes")
            while len(self._buf) < n:
                if not self._more():
                    raise _Failed(f"connection closed after {len(self._buf)} of {n} body bytes")
            return self._buf[:n]
        while self._more():
            if len(self._buf) > cap:
                raise _Failed(f"answer larger than {cap} bytes")
        return self._buf

    def _chunked(self, cap: int) -> bytes:
        out = bytearray()
        pos = 0
        while True:
            line_end = self._buf.find(b"\r\n", pos)
            while line_end < 0:
                if len(self._buf) - pos > 1024:
                    raise _Failed("bad chunk size line")
                if not self._more():
                    raise _Failed("connection closed inside a chunked body")
                line_end = self._buf.find(b"\r\n", pos)
            size_text = self._buf[pos:line_end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _Failed(f"bad chunk size: {one_line(repr(size_text[:40].decode('latin-1')))}") from None
            if size < 0 or len(out) + size > cap:
                raise _Failed(f"answer larger than {cap} bytes")
            start = line_end + 2
            while len(self._buf) < start + size + 2:
                if not self._more():
                    raise _Failed("connection closed inside a chunked body")
            if size == 0:
                return bytes(out)  # trailers, if any, are not read: Connection: close ends them
            out += self._buf[start : start + size]
            pos = start + size + 2
