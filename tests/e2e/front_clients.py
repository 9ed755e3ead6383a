"""Streams through the front, run inside the nspawn machine by tests/e2e/test_vllm_front_systemd.py.

`python3 front_clients.py PORT COUNT MARKER`: COUNT greedy streams (paced by tests/e2e/pace_logits.py), first
uninterrupted (the references), then again; once every stream of the second round has 3 chunks it writes MARKER
(the test then restarts the engine's unit) and reads every stream to its end.  Prints one JSON document: each
stream's text in both rounds and every error chunk or HTTP error a client saw.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp

MAX_TOKENS = 200


async def stream(client: aiohttp.ClientSession, i: int, seen: dict[str, Any]) -> None:
    body = {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "vllm_xargs": {"kimi_pace": 1}}
    async with client.post("/v1/completions", json=body) as answer:
        if answer.status != 200:
            seen["errors"].append(f"HTTP {answer.status}: {(await answer.text())[:300]}")
            return
        buf = b""
        async for piece in answer.content.iter_any():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    seen["done"] = True
                    continue
                doc = json.loads(data)
                if "error" in doc:
                    seen["errors"].append(doc)
                for choice in doc.get("choices", []):
                    seen["text"] += choice.get("text") or ""
                seen["chunks"] += 1


async def round_of(client: aiohttp.ClientSession, count: int, marker: Path | None) -> list[dict[str, Any]]:
    seen = [{"text": "", "errors": [], "chunks": 0, "done": False} for _ in range(count)]
    tasks = [asyncio.ensure_future(stream(client, i, seen[i])) for i in range(count)]
    if marker is not None:
        while not all(s["chunks"] >= 3 for s in seen) and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        marker.write_text("open\n")
    for task in tasks:
        try:
            await task
        except Exception as exc:  # a client error is the result, not a crash of this script
            seen[tasks.index(task)]["errors"].append(f"{type(exc).__name__}: {exc}")
    return seen


async def main(port: int, count: int, marker: Path) -> None:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as client:
        reference = await round_of(client, count, None)
        restarted = await round_of(client, count, marker)
    print(json.dumps({"reference": reference, "restarted": restarted}))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
