"""Streams through the front, run inside the nspawn machine by tests/e2e/test_vllm_front_systemd.py.

`python3 front_clients.py PORT COUNT MARKER [ENGINE_STATE]`: COUNT greedy streams (paced by tests/e2e/pace_logits.py),
first uninterrupted (the references), then again; once every stream of the second round has 3 chunks it writes
MARKER (the test then restarts the engine's unit, and removes MARKER once it is back) and reads every stream to its
end.  The second round's streams stall while MARKER exists (pace_logits.py, `kimi_stall_while`): none can end
before the restart cuts it, whatever the machine's speed.  With ENGINE_STATE (the
engine supervisor's state file) it also watches the engine's phase meanwhile and sends NEW requests, plain and
streamed, once while the engine stops (drains) and once while it starts again.  Prints one JSON document: each
stream's text in both rounds, every error chunk or HTTP error a client saw, and each new request's phase when it
was sent, answer and latency.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

MAX_TOKENS = 200


async def sse_data(answer: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Each server-sent event's data, as the pieces of the answer arrive (also tests/e2e/test_vllm_front.py's)."""
    buf = b""
    async for piece in answer.content.iter_any():
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for event in events:
            yield event.removeprefix(b"data: ")


NEW_PER_PHASE = 4  # new plain and new streamed requests sent in each phase of the restart
WATCH_S = 900.0


async def stream(
    client: aiohttp.ClientSession,
    i: int,
    seen: dict[str, Any],
    body: dict[str, Any] | None = None,
    stall: Path | None = None,
) -> None:
    path = "/v1/completions"
    if body is None:
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True, "vllm_xargs": {"kimi_pace": 1}}
        if stall is not None:
            body["vllm_xargs"]["kimi_stall_while"] = str(stall)
        if i % 2:  # a chat stream through the engine's kimi_k2 parser: thinking on, its text is reasoning
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Story {i}:"}]
        else:
            body["prompt"] = f"Story {i}:"
    async with client.post(path, json=body) as answer:
        seen["status"] = answer.status
        if answer.status != 200:
            seen["errors"].append(f"HTTP {answer.status}: {(await answer.text())[:300]}")
            return
        async for data in sse_data(answer):
            if data == b"[DONE]":
                seen["done"] = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                seen["errors"].append(doc)
            for choice in doc.get("choices", []):
                delta = choice.get("delta") or {}
                seen["text"] += choice.get("text") or delta.get("content") or ""
                seen["reasoning"] += delta.get("reasoning") or ""
            seen["chunks"] += 1


async def round_of(client: aiohttp.ClientSession, count: int, marker: Path | None) -> list[dict[str, Any]]:
    seen = [{"text": "", "reasoning": "", "errors": [], "chunks": 0, "done": False} for _ in range(count)]
    tasks = [asyncio.ensure_future(stream(client, i, seen[i], stall=marker)) for i in range(count)]
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


def engine_phase(state: Path) -> str | None:
    try:
        phase = json.loads(state.read_text()).get("phase")
    except (OSError, ValueError):
        return None  # between two writers, or replaced under the read
    return phase if isinstance(phase, str) else None


async def new_request(client: aiohttp.ClientSession, i: int, kind: str, phase: str) -> dict[str, Any]:
    """One request sent while the engine is not serving: a short plain completion or a short stream."""
    seen: dict[str, Any] = {"kind": kind, "phase": phase, "status": None, "text": "", "reasoning": "", "errors": []}
    seen |= {"chunks": 0, "done": False}
    body: dict[str, Any] = {"model": "tiny", "prompt": f"New {kind} {i}:", "max_tokens": 8, "temperature": 0}
    body["ignore_eos"] = True
    began = time.monotonic()
    try:
        if kind == "stream":
            await stream(client, i, seen, body | {"stream": True})
        else:
            async with client.post("/v1/completions", json=body) as answer:
                seen["status"] = answer.status
                text = await answer.text()
                if answer.status != 200:
                    seen["errors"].append(f"HTTP {answer.status}: {text[:300]}")
                else:
                    seen["text"] = json.loads(text)["choices"][0]["text"]
                    seen["done"] = True
    except Exception as exc:  # a client error is the result, not a crash of this script
        seen["errors"].append(f"{type(exc).__name__}: {exc}")
    seen["latency_s"] = round(time.monotonic() - began, 3)
    return seen


async def during_restart(client: aiohttp.ClientSession, state: Path) -> list[dict[str, Any]]:
    """NEW_PER_PHASE plain and NEW_PER_PHASE streamed requests at the first sight of the engine stopping, and again
    at the first sight of it starting; until it is ready again (bounded by WATCH_S)."""
    tasks: list[asyncio.Future[dict[str, Any]]] = []
    sent: set[str] = set()
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        phase = engine_phase(state)
        which = {"stopping": "stop", "stopped": "stop", "preflight": "start", "starting": "start"}.get(phase or "")
        if which is not None and which not in sent:
            sent.add(which)
            for _ in range(NEW_PER_PHASE):
                for kind in ("plain", "stream"):
                    tasks.append(asyncio.ensure_future(new_request(client, len(tasks), kind, str(phase))))
        if phase == "ready" and "start" in sent:
            break
        await asyncio.sleep(0.05)
    return list(await asyncio.gather(*tasks))


async def main(port: int, count: int, marker: Path, state: Path | None) -> None:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as client:
        reference = await round_of(client, count, None)
        during: list[dict[str, Any]] = []
        if state is None:
            restarted = await round_of(client, count, marker)
        else:
            restarted, during = await asyncio.gather(round_of(client, count, marker), during_restart(client, state))
    print(json.dumps({"reference": reference, "restarted": restarted, "during": during}))


if __name__ == "__main__":
    state_file = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), state_file))
