#!/usr/bin/env python3
"""docs/spare.md on a GPU, in one command: the weight holder, the engine and its hot spare of one deployment, three
real supervisors around the stand-ins of gpuaccept/ (holder_standin.py, engine_standin.py: vLLM's shape, real GPU
memory, mapped weights, a KV cache of their own; vLLM's CUDA build is not on that machine).

    python3 gpuaccept/spare_scene.py --out DIR [--gib 8] [--engine-kv-gib 8] [--spare-kv-gib 2] [--kills 10] [--fake]

Steps, each a PASS/FAIL line, all in DIR/spare_scene.json and DIR/spare_scene.md:
1. the holder loads GIB GiB per GPU; the engine maps them (`--uds`), with ENGINE_KV GiB of its own;
2. the spare's dry run beside them: `partner_memory` names the engine's memory as the deployment's own, and the
   `memory_plan` adds the weights, the engine and the spare up per GPU;
3. the spare starts beside the serving engine: its preflight does not wait for the engine's memory (without the
   rule a GPU with the engine's GiB on it is busy past its deadline), it maps the same held weights (NVML: one copy
   of the weights, the holder's; the engine's and the spare's processes each hold their KV and context only);
4. the engine's child is SIGKILLed: its supervisor exits 13, the spare answers /health on its socket all along
   (the time from the kill to the spare's next 200 is measured); a new engine supervisor starts beside the
   serving spare (its preflight counts the spare's memory as the deployment's own) and is READY again;
5. the front before them (the real CLI, `front.spare = true`): KILLS times the engine's child SIGKILLed and a new
   streamed completion sent through the front at once, timed to its first token (the spare's); a new engine
   supervisor after each; p50 <= 1 s;
6. the stops: each exits 0 and the GPU memory comes back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import bench_weights_holder as bw  # noqa: E402

from gpuaccept.weights_common import dry_run, scene_report  # noqa: E402
from kimi_supervisor.config.weights import SOCKET_DIR_NAME  # noqa: E402
from testkit.harness import write_config  # noqa: E402
from testkit.procutil import free_port  # noqa: E402

WORK = Path("/var/tmp/kimi-sp")
NAME = "kimi"
GIB = 1 << 30


def common(python: str, **more: Any) -> dict[str, Any]:
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "WEIGHTS_BENCH_DIR": str(WORK / "times")}
    if os.environ.get("WEIGHTS_FAKE") == "1":
        env["WEIGHTS_FAKE"] = "1"
    fake = os.environ.get("WEIGHTS_FAKE") == "1"
    return {
        "preflight": {"check_model": False, "deadline_s": 10, **({"gpus": []} if fake else {})},
        "readiness": {"deadline_s": 600},
        "shutdown": {"grace_s": 20, "gpu_release_timeout_s": 30},
        "paths": {
            "runtime_directory": str(WORK / "run"),
            "state_directory": str(WORK / "state"),
            "cache_directory": str(WORK / "cache"),
        },
        "_env": env,
        **more,
    }


def child(python: str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    return {"argv": [python, str(bw.VLLM), *argv], "env": env}


def health(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(str(sock))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(32)
            return head.startswith(b"HTTP/1.") and head[9:12] == b"200"
    except OSError:
        return False


def wait_until(check: Any, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {bound_s}s: {what}")
        time.sleep(0.01)


def front_serving(port: int, engine: str) -> bool:
    """The front sends new requests to `engine` now (its /front/metrics)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /front/metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return False
    return f'kimi_front_serving_engine{{deployment="{NAME}",engine="{engine}"}} 1.0'.encode() in data


def first_token(port: int) -> float:
    """A streamed completion through the front; the monotonic time its first token's chunk arrives."""
    body = json.dumps({"model": "standin", "prompt": "hi", "max_tokens": 1, "stream": True}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head.encode() + body)
        data = b""
        while b"data: {" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"the front's answer ended without a token: {data[:300]!r}")
            data += chunk
    return time.monotonic()


def procs_mib(snapshot: dict[int, dict[str, Any]], pids: set[int]) -> dict[int, int]:
    """MiB per GPU that the processes `pids` hold, per NVML."""
    return {g: sum(m for p, m in v["procs"].items() if p in pids) for g, v in snapshot.items()}


def tree_pids(sup: bw.Sup) -> set[int]:
    return set(bw.tree(sup.run.proc.pid)) - {sup.run.proc.pid}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=8, help="GiB the holder holds per GPU")
    ap.add_argument("--engine-kv-gib", type=int, default=8)
    ap.add_argument("--spare-kv-gib", type=int, default=2)
    ap.add_argument("--python", default=sys.executable, help="the stand-ins' interpreter (imports torch)")
    ap.add_argument("--fake", action="store_true", help="CPU: no torch/NVML (the orchestration only)")
    ap.add_argument("--kills", type=int, default=10, help="kills of the engine with the front before it")
    a = ap.parse_args()
    if a.fake:
        os.environ["WEIGHTS_FAKE"] = "1"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    (WORK / "times").mkdir()
    model = WORK / "model"
    res: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    ngpu = len(bw.nvml())
    res["idle"] = bw.nvml()
    holder = engine = spare = None
    try:
        res["weights"] = bw.make_weights(model, a.gib, 120)
        base = common(a.python)
        env = base.pop("_env")
        sockets = WORK / "run" / NAME / SOCKET_DIR_NAME
        preload = ["preload", "--model", str(model), "-tp", str(ngpu)]
        holder_cfg = write_config(
            WORK / f"{NAME}.weights.toml",
            {
                "child": child(a.python, preload, env),
                "deployment": {"name": NAME, "role": "weights"},
                "weights": {"health_port": free_port()},
                **base,
            },
        )
        engine_sock = WORK / "run" / NAME / "front" / "engine.sock"
        extra = json.dumps({"socket_dir": str(sockets), "mode": "zero_copy", "fallback": False})
        serve = ["serve", str(model), "--tensor-parallel-size", str(ngpu), "--uds", str(engine_sock)]
        serve += ["--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", str(a.engine_kv_gib * GIB)]
        serve += ["--enable-scale-out", "--load-format", "ipc_cache", "--model-loader-extra-config", extra]
        engine_cfg = write_config(
            WORK / f"{NAME}.toml",
            {
                "child": child(a.python, serve, env),
                "deployment": {"name": NAME},
                "weights": {"holder": True, "wait_s": 120},
                **base,
            },
        )
        spare_cfg = write_config(
            WORK / f"{NAME}.spare.toml",
            {
                "deployment": {"name": NAME, "role": "spare"},
                "spare": {
                    "kv_cache_memory_bytes": a.spare_kv_gib * GIB,
                    "gpu_memory_utilization": 0.3,
                    "overhead_mib": 1024,
                },
                **{k: v for k, v in base.items() if k != "paths"},
                "preflight": {k: v for k, v in base["preflight"].items() if k != "gpus"},
            },
        )
        spare_sock = WORK / "run" / NAME / "front" / "spare.sock"
        # 1. holder, engine
        holder = bw.Sup(holder_cfg, WORK, "holder")
        res["holder_ready_s"] = holder.ready(600) - holder.t0
        engine = bw.Sup(engine_cfg, WORK, "engine")
        res["engine_ready_s"] = engine.ready(300) - engine.t0
        bw.expect("holder and engine READY, the engine on its socket", health(engine_sock), str(engine_sock))
        with_engine = bw.nvml()
        # 2. the spare's dry run beside them
        dry = dry_run(spare_cfg)
        res["spare_dry_run"] = {"rc": dry.returncode, "out": dry.stdout[-3000:]}
        lines = [ln for ln in dry.stdout.splitlines() if "memory_plan" in ln or "partner_memory" in ln]
        res["plan_lines"] = lines
        if not a.fake:
            bw.expect(
                "the spare's dry run: the engine's memory is the deployment's own (partner_memory) and the plan fits",
                dry.returncode == 0
                and any("partner_memory" in ln for ln in lines)
                and any("memory_plan" in ln and "fit on each" in ln for ln in lines),
                " | ".join(lines)[:600],
            )
        # 3. the spare beside the serving engine
        spare = bw.Sup(spare_cfg, WORK, "spare")
        res["spare_ready_s"] = spare.ready(300) - spare.t0
        bw.expect("the spare READY beside the serving engine, on its own socket", health(spare_sock), str(spare_sock))
        trio = bw.nvml()
        res["nvml_trio"] = trio
        if not a.fake:
            h, e, s = tree_pids(holder), tree_pids(engine), tree_pids(spare)
            rows = []
            for g in trio:
                rows.append(
                    {
                        "gpu": g,
                        "used_mib": trio[g]["used_mib"],
                        "holder_mib": procs_mib(trio, h)[g],
                        "engine_mib": procs_mib(trio, e)[g],
                        "spare_mib": procs_mib(trio, s)[g],
                    }
                )
            res["per_gpu"] = rows
            weights_mib = a.gib * 1024
            bw.expect(
                "one copy of the weights: the holder holds them, the engine and the spare each hold less than them "
                "(their own KV and context), the spare its KV + a context",
                all(
                    r["holder_mib"] >= weights_mib
                    and r["engine_mib"] < a.engine_kv_gib * 1024 + weights_mib
                    and a.spare_kv_gib * 1024 <= r["spare_mib"] < a.spare_kv_gib * 1024 + weights_mib
                    for r in rows
                ),
                json.dumps(rows),
            )
            bw.expect(
                "the GPU holds weights + engine + spare, not two copies of the weights",
                all(r["used_mib"] < 2 * weights_mib + a.engine_kv_gib * 1024 + a.spare_kv_gib * 1024 for r in rows),
                json.dumps(rows),
            )
            res["with_engine"] = with_engine
        # 4. the engine's child SIGKILLed: the spare answers all along; a new engine beside it
        victim = engine.child()
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        gaps = []
        while time.monotonic() - t_kill < 5:
            t = time.monotonic()
            gaps.append((t - t_kill, health(spare_sock)))
            if engine.run.proc.poll() is not None and len(gaps) > 3:
                break
            time.sleep(0.005)
        rc = engine.run.wait(60)
        res["spare_during_kill"] = {"probes": len(gaps), "all_200": all(ok for _, ok in gaps)}
        res["kill_to_spare_200_s"] = next((t for t, ok in gaps if ok), None)
        bw.expect(
            "the engine's child SIGKILLed: its supervisor exits 13, the spare answers 200 throughout",
            rc == 13 and all(ok for _, ok in gaps),
            json.dumps(res["spare_during_kill"]) + f", first 200 {res['kill_to_spare_200_s']}",
        )
        engine = bw.Sup(engine_cfg, WORK, "engine2")
        res["engine_restart_ready_s"] = engine.ready(300) - engine.t0
        partner = [e for e in engine.run.events if "partner_memory" in json.dumps(e)]
        bw.expect(
            "a new engine beside the serving spare: READY (the spare's memory the deployment's own)",
            health(engine_sock) and health(spare_sock),
            f"{res['engine_restart_ready_s']:.2f} s; {len(partner)} event(s) naming partner_memory",
        )
        # 5. the front before them: KILLS kills of the engine's child, a new streamed request through the front
        # at each, timed to its first token (the spare's); a new engine supervisor after each
        port = free_port()
        front_cfg = write_config(
            WORK / f"{NAME}.front.toml",
            {
                "deployment": {"name": NAME, "role": "front"},
                "front": {"host": "127.0.0.1", "port": port, "spare": True, "hold_s": 60},
                "paths": base["paths"],
            },
        )
        front = subprocess.Popen(
            [sys.executable, "-m", "kimi_supervisor", "--config", str(front_cfg)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
            stdout=subprocess.DEVNULL,
            stderr=(WORK / "front.log").open("wb"),
        )
        firsts: list[float] = []
        rcs13: list[int] = []
        try:
            for k in range(a.kills):
                wait_until(lambda: front_serving(port, "main"), 60, "the front sends to the engine")
                victim = engine.child()
                t_kill = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                firsts.append(first_token(port) - t_kill)
                rcs13.append(engine.run.wait(60))
                engine = bw.Sup(engine_cfg, WORK, f"engine{k + 3}")
                engine.ready(300)
        finally:
            front.send_signal(signal.SIGTERM)
            front_rc = front.wait(30)
        res["front_kill_to_first_token_s"] = firsts
        p50 = sorted(firsts)[len(firsts) // 2] if firsts else None
        bw.expect(
            f"the front before them: the engine's child SIGKILLed {a.kills} times, a new streamed request's first "
            "token through the front (the spare's) each time: p50 <= 1 s",
            len(firsts) == a.kills and p50 is not None and p50 <= 1.0 and rcs13 == [13] * a.kills and front_rc == 0,
            f"p50 {p50 and round(p50 * 1000, 1)} ms, max {firsts and round(max(firsts) * 1000, 1)} ms, "
            f"engine exits {rcs13}, front exit {front_rc}",
        )
        # 6. stops
        rcs = []
        for sup in (spare, engine, holder):
            rcs.append(sup.stop()[0])
        spare = engine = holder = None
        idle = max(v["used_mib"] for v in res["idle"].values())
        ok, _, now_mib = bw.wait_freed(idle + 200, 60)
        bw.expect("the stops: each exits 0, the GPU memory back", rcs == [0, 0, 0] and ok, f"{rcs}, {now_mib} MiB")
    except Exception as exc:  # the scene reports what it reached, whatever stopped it
        bw.expect("the scene ran to its end", False, f"{type(exc).__name__}: {exc}")
    finally:
        for sup in (spare, engine, holder):
            if sup is not None:
                sup.stop()
        bw.cleanup()
    return scene_report(out, "spare_scene", "Spare scene (issue 51)", res, bw.CHECKS)


if __name__ == "__main__":
    sys.exit(main())
