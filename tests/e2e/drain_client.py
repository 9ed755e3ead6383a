"""Stream one long completion; once `--stop-after` tokens arrived, run a stop command; report JSON.

Used by the real-vLLM drain tests on the host and inside the nspawn container (stdlib only), so the
client, the stop and their timings live in one process: `stop_returned_s` vs `stream_end_s` says
whether the stop waited for the generation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
import urllib.request
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--stop-after", type=int, default=50)
    ap.add_argument("--stop", nargs=argparse.REMAINDER, required=True, help="the stop command, e.g. systemctl stop X")
    args = ap.parse_args()
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": args.max_tokens, "temperature": 0}
    body.update(ignore_eos=True, stream=True)
    req = urllib.request.Request(
        args.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    out: dict[str, Any] = {"chunks": 0, "finish_reason": None, "done": False, "error": None, "status": None}
    t0 = time.monotonic()
    stopper: threading.Thread | None = None

    def stop() -> None:
        out["stop_started_s"] = round(time.monotonic() - t0, 2)
        result = subprocess.run(args.stop, capture_output=True, text=True, timeout=600)
        out["stop_rc"] = result.returncode
        out["stop_stderr"] = result.stderr[-500:]
        out["stop_returned_s"] = round(time.monotonic() - t0, 2)

    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            out["status"] = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    out["chunks"] += 1
                    if "error" in obj:
                        out["error"] = str(obj["error"])[:300]
                    for ch in obj.get("choices", []):
                        out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]
                    if out["chunks"] == args.stop_after and stopper is None:
                        out["chunks_at_stop"] = out["chunks"]
                        stopper = threading.Thread(target=stop)
                        stopper.start()
    except Exception as exc:  # the test reads what the client saw, whatever it was
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["stream_end_s"] = round(time.monotonic() - t0, 2)
    out["t0_monotonic"] = t0  # CLOCK_MONOTONIC: comparable with the caller's time.monotonic() on one host
    if stopper is not None:
        stopper.join(600)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
