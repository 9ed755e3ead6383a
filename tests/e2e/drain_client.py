"""Stream one long completion that only ends when released, run a stop command once it is provably in flight,
release it once SIGTERM has landed (with `--release`); report JSON.

Used inside the nspawn container by the real-vLLM drain test (stdlib and testkit/sse_client.py only: nothing is
installed there), so the client, the stop and their timings live in one process: `stop_returned_s` vs
`stream_end_s` says whether the stop waited for the generation.  The generation is held by
tests/e2e/hold_logits.py (`vllm_xargs.kimi_hold`): it cannot end before the test lets it, on any machine.

In flight, provably: the client has `--stop-after` chunks, vLLM's own /metrics counts one request running, and
the supervisor has read /metrics twice more since (its access-log lines in `--log-cmd`'s output): its latest
sample saw the request, whether it counts at SIGTERM from that sample or reads again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script (also inside the container, where the checkout is bound at its host path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from testkit.sse_client import stream_completion

METRICS_LINE = '"GET /metrics HTTP/1.1" 200'


def running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("vllm:num_requests_running"))


def wait(what: str, predicate: Callable[[], object], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"drain_client: not within {timeout}s: {what}")
        time.sleep(0.05)


def drive(
    url: str,
    max_tokens: int,
    hold: Path,
    release: bool,
    metrics_reads: Callable[[], int],
    landed: Callable[[], bool],
    stop: Callable[[dict[str, Any]], None],
    stop_after: int = 50,
) -> dict[str, Any]:
    """The stream, the stop once it is provably in flight (`stop(out)`, in a thread), the release once `landed`.
    `metrics_reads`: how many /metrics answers the supervised vLLM's access log shows so far."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}
    body["vllm_xargs"] = {"kimi_hold": str(hold)}
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    out["t0_monotonic"] = t0  # CLOCK_MONOTONIC: comparable with the caller's time.monotonic() on one host
    streamer = threading.Thread(target=stream_completion, args=(url + "/v1/completions", body, out, 600))
    streamer.start()
    stopper = None
    try:
        wait("chunks at the client", lambda: out.get("chunks", 0) >= stop_after or out.get("done"))
        wait("vLLM counting it running", lambda: running(url) >= 1)
        seen = metrics_reads()
        wait("two more supervisor /metrics reads", lambda: metrics_reads() >= seen + 2)
        out["chunks_at_stop"], out["done_at_stop"] = out["chunks"], out["done"]
        stopper = threading.Thread(target=stop, args=(out,))
        out["stop_started_s"] = round(time.monotonic() - t0, 2)
        stopper.start()
        wait("SIGTERM landed", landed)
        out["chunks_at_sigterm"], out["done_at_sigterm"] = out["chunks"], out["done"]
        if release:
            hold.touch()
            out["released_s"] = round(time.monotonic() - t0, 2)
        streamer.join(600)
        out["stream_end_s"] = round(time.monotonic() - t0, 2)
    finally:
        hold.touch()  # never leave a generation held (it was released, or aborted)
        streamer.join(60)
        if stopper is not None:
            stopper.join(600)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--hold", required=True, help="the file that releases the generation (hold_logits.py)")
    ap.add_argument("--log-cmd", required=True, help="prints the supervised vLLM's output so far (its access log)")
    ap.add_argument("--landed-cmd", required=True, help="exits 0 once the supervisor has sent SIGTERM")
    ap.add_argument("--release", action="store_true", help="release the generation once SIGTERM has landed")
    ap.add_argument("--stop", nargs=argparse.REMAINDER, required=True, help="the stop command, e.g. systemctl stop X")
    args = ap.parse_args()

    def metrics_reads() -> int:
        return subprocess.run(args.log_cmd, shell=True, capture_output=True, text=True).stdout.count(METRICS_LINE)

    def stop(out: dict[str, Any]) -> None:
        result = subprocess.run(args.stop, capture_output=True, text=True, timeout=600)
        out["stop_rc"] = result.returncode
        out["stop_stderr"] = result.stderr[-500:]
        out["stop_returned_s"] = round(time.monotonic() - out["t0_monotonic"], 2)

    def landed() -> bool:
        return subprocess.run(args.landed_cmd, shell=True).returncode == 0

    out = drive(args.url, args.max_tokens, Path(args.hold), args.release, metrics_reads, landed, stop)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
