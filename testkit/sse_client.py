"""A streaming-completion client that tallies what it saw: shared by the drain tests (the fake, the real vLLM
on the host and inside the nspawn container) and bench/vllm_drain.py.

Stdlib only: tests/e2e/drain_client.py imports it inside the container, with nothing installed there.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any


def stream_completion(
    url: str,
    body: dict[str, Any],
    out: dict[str, Any],
    timeout: float,
    on_chunk: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """POST BODY (with stream=true) to URL and fill OUT as chunks arrive, so another thread can watch it:
    status, chunks (data events), finish_reason (the last one given), done ([DONE] came), error (the first
    error event, or the exception that ended the stream; None if neither). ON_CHUNK(out) after each chunk.
    """
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    out.update(status=None, chunks=0, finish_reason=None, done=False, error=None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out["status"] = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    out["chunks"] += 1
                    if obj.get("error") is not None and out["error"] is None:
                        out["error"] = str(obj["error"])[:300]
                    for ch in obj.get("choices", []):
                        out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
                    if on_chunk is not None:
                        on_chunk(out)
    except Exception as exc:  # the caller reads what the client saw, whatever ended the stream
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
