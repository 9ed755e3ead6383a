"""Reading a peer's status (a fixed shape, every field checked) and probing the leader's master port."""

from __future__ import annotations

import socket

from kimi_supervisor.deployment.group.peers import PortState, parse_status, probe_port


def test_a_peer_document_is_checked_field_by_field() -> None:
    good = b'{"role":"leader","node_rank":0,"run_id":"aa","state":"ready","argv_digest":""}'
    assert parse_status(good).state == "ready"
    for bad, words in [
        (b"[]", "not a JSON object"),
        (good.replace(b'"ready"', b'"rm -rf"'), "state: expected one of"),
        (good.replace(b'"aa"', b'"../x"'), "run_id: expected hex digits"),
        (good.replace(b'"leader"', b'"root"'), "role: expected"),
        (good.replace(b"0,", b"true,"), "node_rank"),
        (b" " * 300_000, "at most 262144"),
    ]:
        try:
            parse_status(bad)
        except ValueError as exc:
            assert words in str(exc), (bad[:40], exc)
        else:
            raise AssertionError(f"accepted {bad[:40]!r}")


def test_master_port_probe_tells_refused_from_open() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        assert probe_port("127.0.0.1", port, 1.0)[0] is PortState.OPEN
    finally:
        listener.close()
    assert probe_port("127.0.0.1", port, 1.0)[0] is PortState.REFUSED
