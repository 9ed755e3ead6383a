"""The engine as the front reaches it: HTTP over its Unix socket (vLLM's --uds), through aiohttp's client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

# What a broken engine connection raises: refused or missing socket, reset, a body cut short.
BROKEN = (aiohttp.ClientError, ConnectionError, OSError)
BASE = "http://engine"  # the host is the socket: this name only fills the request line's Host


class Upstream:
    def __init__(self, socket: Path, probe_timeout_s: float) -> None:
        self.socket = socket
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        # No pool limit (vLLM queues requests itself), no decompression (bytes pass through as they are), no
        # total timeout (a stream lasts as long as it generates); connecting is bounded by the probe's timeout.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(socket), limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=probe_timeout_s),
        )

    async def healthy(self) -> bool:
        """GET /health answered 200 within the probe's timeout."""
        try:
            async with self.session.get(BASE + "/health", timeout=self._probe_timeout) as answer:
                await answer.read()
                return answer.status == 200
        except (*BROKEN, asyncio.TimeoutError):
            return False

    async def close(self) -> None:
        await self.session.close()
