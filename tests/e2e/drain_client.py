"""Stream one long completion; once `--stop-after` tokens arrived, run a stop command; report JSON.

Used by the real-vLLM drain tests on the host and inside the nspawn container (stdlib and
tests/sse_client.py only: nothing is installed there), so the client, the stop and their timings live in
one process: `stop_returned_s` vs `stream_end_s` says whether the stop waited for the generation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script (also inside the container, where the checkout is bound at its host path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.sse_client import stream_completion


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--stop-after", type=int, default=50)
    ap.add_argument("--stop", nargs=argparse.REMAINDER, required=True, help="the stop command, e.g. systemctl stop X")
    args = ap.parse_args()
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    stopper: threading.Thread | None = None

    def stop() -> None:
        out["stop_started_s"] = round(time.monotonic() - t0, 2)
        result = subprocess.run(args.stop, capture_output=True, text=True, timeout=600)
        out["stop_rc"] = result.returncode
        out["stop_stderr"] = result.stderr[-500:]
        out["stop_returned_s"] = round(time.monotonic() - t0, 2)

    def on_chunk(seen: dict[str, Any]) -> None:
        nonlocal stopper
        if seen["chunks"] == args.stop_after and stopper is None:
            seen["chunks_at_stop"] = seen["chunks"]
            stopper = threading.Thread(target=stop)
            stopper.start()

    stream_completion(args.url + "/v1/completions", body, out, 600, on_chunk)
    out["stream_end_s"] = round(time.monotonic() - t0, 2)
    out["t0_monotonic"] = t0  # CLOCK_MONOTONIC: comparable with the caller's time.monotonic() on one host
    if stopper is not None:
        stopper.join(600)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
