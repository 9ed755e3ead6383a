"""A journald stand-in: binds a datagram socket and decodes the native protocol."""

from __future__ import annotations

import socket
import struct
from pathlib import Path


def decode(datagram: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    i = 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            i = nl + 1
        else:
            (size,) = struct.unpack("<Q", datagram[nl + 1 : nl + 9])
            fields[line.decode()] = datagram[nl + 9 : nl + 9 + size].decode()
            i = nl + 9 + size + 1
    return fields


class JournalSocket:
    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "journal.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def records(self) -> list[dict[str, str]]:
        out = []
        while True:
            try:
                out.append(decode(self.sock.recv(1 << 20)))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()
