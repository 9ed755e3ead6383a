"""Measure vLLM's SIGTERM drain on the CPU tier: what happens to an in-flight stream, and how long the
process tree takes to exit beyond the drain (the margin `shutdown.grace_s` must add to --shutdown-timeout).

Usage: flock /work/heavy.lock python3 bench/vllm_drain.py --runs 3 --timeouts 0,30 --targets main,group
Writes bench/results/vllm_drain_cpu.md (and .json) with every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_supervisor.host.procident import alive as ident_alive  # noqa: E402
from kimi_supervisor.host.procident import identify, send_signal  # noqa: E402
from kimi_supervisor.liveness.vllm_metrics import MetricsError, fetch_metrics  # noqa: E402
from testkit.sse_client import stream_completion  # noqa: E402
from testkit.vllm_serve import MODEL_DIR, VENV, VLLM_ENV, long_generation_argv  # noqa: E402

HANG_S = 75.0  # longer than any --shutdown-timeout measured here plus its teardown


def stream(url: str, max_tokens: int, out: dict[str, Any]) -> None:
    """The stream as the bench reads it: every chunk's arrival time, and when it ended."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out["chunk_times"] = []
    stream_completion(url, body, out, 600, lambda seen: seen["chunk_times"].append(time.monotonic()))
    out["end"] = time.monotonic()


def one_run(port: int, timeout_s: int, target: str, max_tokens: int, sigterm_after: float) -> dict[str, Any]:
    argv = long_generation_argv(VENV / "bin" / "vllm", MODEL_DIR, port, timeout_s)
    log = open(f"/tmp/vllm_drain_{port}_{timeout_s}_{target}_{int(time.time())}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        argv, env={**os.environ, **VLLM_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            raise SystemExit(f"vLLM did not start (rc {proc.poll()}); see {log.name}")
        time.sleep(0.2)
    out: dict[str, Any] = {}
    th = threading.Thread(target=stream, args=(base + "/v1/completions", max_tokens, out))
    th.start()
    while out.get("chunks", 0) < 5 and "end" not in out:
        time.sleep(0.05)
    time.sleep(sigterm_after)
    # (PID, start time): a member that exits can leave its PID to a newcomer, which is neither signalled nor waited for.
    found = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    members = [i for i in (identify(pid) for pid in found) if i is not None]
    try:
        in_flight = fetch_metrics(base + "/metrics", 2.0).in_flight
    except MetricsError:
        in_flight = None  # the event loop is busy streaming: seen once at > 2 s
    chunks_at_term = out["chunks"]
    t_term = time.monotonic()
    if target == "main":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        for member in members[1:]:
            send_signal(member, signal.SIGTERM)
    samples: list[tuple[float, float | None]] = []
    main_exit = None
    hung = False
    while True:
        if time.monotonic() - t_term > HANG_S:
            # vLLM did not exit on its own (seen: uvicorn "Waiting for connections to close" forever).
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            main_exit = main_exit or time.monotonic() - t_term
            break
        if main_exit is None and proc.poll() is not None:
            main_exit = time.monotonic() - t_term
        alive = [m for m in members if ident_alive(m)]
        if not alive and main_exit is not None:
            break
        if main_exit is None:
            try:
                m = fetch_metrics(base + "/metrics", 0.5)
                samples.append((round(time.monotonic() - t_term, 2), m.in_flight))
            except MetricsError as exc:
                samples.append((round(time.monotonic() - t_term, 2), None))
                _ = exc
        time.sleep(0.25)
    tree_gone = time.monotonic() - t_term
    th.join(5 if hung else 30)
    last_chunk = out["chunk_times"][-1] - t_term if out["chunk_times"] else None
    times = out["chunk_times"][:chunks_at_term]
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    stream_end = out.get("end", time.monotonic()) - t_term
    return {
        "shutdown_timeout": timeout_s,
        "target": target,
        "in_flight_at_sigterm": in_flight,
        "tokens_before_sigterm": chunks_at_term,
        "tokens_per_s": round(rate, 1) if rate else None,
        "tokens_total": out["chunks"],
        "status": out["status"],
        "finish_reason": out["finish_reason"],
        "done": out["done"],
        "error": out["error"],
        "last_token_s": round(last_chunk, 2) if last_chunk is not None else None,
        "stream_end_s": round(stream_end, 2),
        "main_exit_s": round(main_exit, 2),
        "rc": proc.returncode,
        "hung_sigkilled": hung,
        "tree_gone_s": round(tree_gone, 2),
        "margin_after_stream_s": round(tree_gone - max(0.0, stream_end), 2),
        "metrics_samples": samples[:6] + samples[-2:],
        "log": log.name,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeouts", default="0,30")
    ap.add_argument("--targets", default="main,group")
    ap.add_argument("--max-tokens", type=int, default=480)
    ap.add_argument("--sigterm-after", type=float, default=0.5)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_drain_cpu"))
    args = ap.parse_args()
    rows = []
    for _ in range(args.runs):
        for t in [int(x) for x in args.timeouts.split(",")]:
            for target in args.targets.split(","):
                row = one_run(args.port, t, target, args.max_tokens, args.sigterm_after)
                print(json.dumps(row), flush=True)
                rows.append(row)
    Path(args.out + ".json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
