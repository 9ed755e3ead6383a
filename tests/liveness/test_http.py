"""The one HTTP client (kimi_supervisor/liveness/http.py) against loopback servers that trickle, lie and nest."""

from __future__ import annotations

import time

import pytest

from kimi_supervisor.liveness.http import finite_count, one_line, request
from kimi_supervisor.quoting import escape_unprintable
from testkit.harness import free_port
from tests.rawserver import answer, raw_server

HEAD_200 = b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-length: 0\r\n\r\n"


def test_a_complete_answer() -> None:
    with raw_server(*answer("200 OK", b'{"choices": [1]}')) as srv:
        a = request("POST", srv.url("/v1/completions"), 2.0, body=b"{}", headers={"Content-Type": "application/json"})
    assert (a.ok, a.http_status, a.body, a.error) == (True, 200, b'{"choices": [1]}', None)


def test_a_status_line_trickled_one_byte_per_0_9s_ends_at_the_deadline() -> None:
    # A per-recv timeout never trips on this: each byte comes well within it.
    with raw_server(HEAD_200, head_byte_s=0.9) as srv:
        start = time.monotonic()
        a = request("GET", srv.url("/metrics"), 1.0)
        took = time.monotonic() - start
    assert (a.ok, a.http_status, a.error) == (False, None, "no answer within 1s")
    # Ended by the deadline, not by the answer: the whole status line needs 0.9 s a byte (~50 s).  An upper bound
    # of that size is decided by cause; one near 1 s was this loaded machine's speed.
    assert 0.95 <= took < len(HEAD_200) * 0.9, took


def test_a_body_trickled_after_headers_sent_at_once_ends_at_the_deadline() -> None:
    head, body = answer("200 OK", b'{"choices": [{"text": "x"}]}' + b" " * 60)
    with raw_server(head, body, body_byte_s=0.3) as srv:
        start = time.monotonic()
        a = request("POST", srv.url("/v1/completions"), 1.0, body=b"{}")
        took = time.monotonic() - start
    assert (a.ok, a.http_status, a.error) == (False, 200, "no complete answer within 1s")
    assert 0.95 <= took < len(body) * 0.3, took  # the deadline ended it, not the body (~26 s at 0.3 s a byte)


def test_body_cap_by_length_and_by_reading_to_close() -> None:
    with raw_server(*answer("200 OK", b"x" * 5000)) as srv:
        a = request("GET", srv.url("/metrics"), 2.0, max_body=4096)
    assert (a.ok, a.error) == (False, "answer larger than 4096 bytes")
    with raw_server(b"HTTP/1.1 200 OK\r\n\r\n", b"y" * 200_000) as srv:
        a = request("GET", srv.url("/metrics"), 2.0, max_body=100_000)
    assert (a.ok, a.error) == (False, "answer larger than 100000 bytes")


def test_a_chunked_body_is_decoded() -> None:
    body = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
    with raw_server(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", body) as srv:
        a = request("GET", srv.url("/metrics"), 2.0)
    assert (a.ok, a.body) == (True, b"hello, world")


@pytest.mark.parametrize(
    ("head", "body", "error"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", b"", "not an HTTP status line: 'SSH-2.0-OpenSSH_9.6'"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", b"", "not an HTTP status line: 'HTTP/1.1 2x0 OK'"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", b"", "bad Content-Length: '-1'"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", b"abc", "connection closed after 3 of 10 body bytes"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"zz\r\n", "bad chunk size: 'zz'"),
        (b"HTTP/1.1 200 OK\r\nserver: x", b"", "connection closed before the response headers ended"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000, b"", "response headers longer than 65536 bytes"),
    ],
)
def test_every_bad_answer_is_a_one_line_failure(head: bytes, body: bytes, error: str) -> None:
    with raw_server(head, body) as srv:
        a = request("GET", srv.url("/health"), 2.0)
    assert (a.ok, a.error) == (False, error)


def test_refused_is_said_plainly() -> None:
    a = request("GET", f"http://127.0.0.1:{free_port()}/health", 1.0)
    assert (a.ok, a.http_status, a.error) == (False, None, "connection refused")


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -1.0])
def test_a_count_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ValueError, match=r"vllm:num_requests_running is .*: not a count"):
        finite_count("vllm:num_requests_running", value)
    assert finite_count("vllm:num_requests_running", 3.0) == 3.0


def _one_line_before(text: str, limit: int = 300) -> str:
    """one_line as it was, escaping by itself: the reference for the characters it escaped the same way."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text[: limit * 2])[:limit]


def test_one_line_is_the_escaper_of_quoting_and_says_what_it_said_below_u0100() -> None:
    latin1 = "".join(map(chr, range(0x100)))
    assert one_line(latin1, 1000) == _one_line_before(latin1, 1000) == escape_unprintable(latin1)
    text = "GET /health: \x1b[2J\nTraceback\r\x85" * 40
    assert one_line(text) == _one_line_before(text)
    assert len(one_line(text)) == 300 and one_line(text, 40) == _one_line_before(text, 40)
    # Above U+00FF its own `\x{code:02x}` was ambiguous (U+202E read as `\x202e`: \x20 then "2e"):
    # quoting's notation says `\u202e`, as `status` and the preflight report do.
    assert one_line("a\u202eb\u2028c") == "a\\u202eb\\u2028c" != _one_line_before("a\u202eb\u2028c")


def test_an_engine_on_a_unix_socket_is_reached_through_its_uds_url(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's --uds (an engine behind its front, docs/front.md): /health, the canary and /metrics go there."""
    import socket
    import tempfile
    import threading

    from kimi_supervisor.config.vllm_args import parse_vllm_args

    directory = tempfile.mkdtemp(prefix="kuds-", dir="/tmp")  # a socket path has at most 107 bytes
    path = f"{directory}/engine sock"  # a space: the URL carries the path percent-encoded
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            got.append(data)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = parse_vllm_args(["vllm", "serve", "m", "--uds", path]).api_url("/health")
    assert url.startswith("http+unix://%2Ftmp%2Fkuds-") and url.endswith("engine%20sock/health")
    a = request("GET", url, 10.0)
    thread.join(10)
    server.close()
    import shutil

    shutil.rmtree(directory)
    assert (a.ok, a.http_status, a.body) == (True, 200, b"ok")
    assert got[0].startswith(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
