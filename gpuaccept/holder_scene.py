#!/usr/bin/env python3
"""docs/weight-holder.md on the GPUs, in one command: the weight holder and its engine run as a child user (not root),
under the longest deployment name whose sockets still fit a Unix socket, and the engine's preflight is tried at a
--gpu-memory-utilization near the limit, against vLLM's own rule, with the stand-ins of gpuaccept/
(holder_standin.py, engine_standin.py: vLLM's shape, real GPU memory; vLLM's CUDA build is not on that machine).

    python3 gpuaccept/holder_scene.py --out DIR [--gib 8] [--user nobody] [--python /usr/bin/python3]

Steps, each a PASS/FAIL line, all in DIR/holder_scene.json and DIR/holder_scene.md:
1. names: a deployment name one character longer than fits is refused when its config is read (exit 78, the
   length against 107); the longest that fits (17 characters under a 20-character runtime directory, as under
   /run/kimi-supervisor) is the one used below;
2. users: the holder's supervisor (root) runs `vllm preload` as USER; it must reach READY (the socket directory
   made for USER before the load, docs/weight-holder.md);
3. memory rule: per GPU, NVML's free F, the holder's NVML use U and its daemons' own get_memory answer A (what
   vLLM subtracts).  At a utilisation between (F + A) / total and (F + U) / total the engine's preflight must
   refuse (exit 10, gpu_memory_fraction) and vLLM's rule (the engine stand-in, as USER, outside any supervisor)
   must refuse too; at (F + A - 1 GiB) / total both pass and the engine (as USER) maps the held weights to
   READY.  The margin is the engine's own CUDA context, which vLLM's free-memory snapshot already counts;
4. stop: the engine's stop leaves the holder serving;
5. another user: an engine whose child.user is root beside the holder run as USER is refused, never READY
   (item 1; the daemon itself rejects a root peer by SO_PEERCRED); then the holder's stop ends with its GPU
   memory back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pwd
import shutil
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
from kimi_supervisor.config.weights import SOCKET_DIR_NAME, UNIX_PATH_MAX  # noqa: E402
from kimi_supervisor.host.weightcache import allocated  # noqa: E402
from testkit.harness import write_config  # noqa: E402
from testkit.procutil import free_port  # noqa: E402

WORK = Path("/var/tmp/kimi-ws")  # its runtime directory, /var/tmp/kimi-ws/run, is as long as /run/kimi-supervisor
SOCKET_NAME_LEN = len("vllm_weight_cache_") + 32 + len(".sock")  # protocol.py:42, md5 hex


def longest_name(runtime: Path) -> str:
    room = UNIX_PATH_MAX - len(f"{runtime}/") - len(f"/{SOCKET_DIR_NAME}/") - SOCKET_NAME_LEN
    return ("kimi-k25-" + "x" * 64)[:room]


def sections(work: Path, name: str, user: str, python: str, model: Path, argv: list[str], **more: Any) -> Any:
    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "WEIGHTS_BENCH_DIR": str(work / "times")}
    if os.environ.get("WEIGHTS_FAKE") == "1":
        env["WEIGHTS_FAKE"] = "1"
    return {
        "child": {"argv": [python, str(bw.VLLM), *argv], "env": env, "user": user},
        "deployment": {"name": name, **more.pop("deployment", {})},
        "preflight": {"check_model": False, **({"gpus": []} if os.environ.get("WEIGHTS_FAKE") == "1" else {})},
        "readiness": {"deadline_s": 900},
        "shutdown": {"grace_s": 30, "gpu_release_timeout_s": 60},
        "paths": {
            "runtime_directory": str(work / "run"),
            "state_directory": str(work / "state"),
            "cache_directory": str(work / "cache"),
        },
        **more,
    }


def engine_argv(name: str, model: Path, ngpu: int, port: int, util: float, work: Path) -> list[str]:
    extra = json.dumps(
        {"socket_dir": str(work / "run" / name / SOCKET_DIR_NAME), "mode": "zero_copy", "fallback": False}
    )
    return [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(ngpu),
        "--gpu-memory-utilization",
        f"{util:.4f}",
        "--load-format",
        "ipc_cache",
        "--model-loader-extra-config",
        extra,
    ]


def engine_config(
    file: str, name: str, user: str, python: str, model: Path, ngpu: int, util: float, wait_s: float
) -> Path:
    argv = engine_argv(name, model, ngpu, free_port(), util, WORK)
    return write_config(
        WORK / file, sections(WORK, name, user, python, model, argv, weights={"holder": True, "wait_s": wait_s})
    )


def as_user(user: str) -> dict[str, Any]:
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=8, help="GiB the holder holds per GPU")
    ap.add_argument("--user", default="nobody", help="child.user of the holder and the engine")
    ap.add_argument(
        "--python",
        default="/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
        help="the stand-ins' interpreter: USER must be able to run it and import torch",
    )
    ap.add_argument("--fake", action="store_true", help="CPU: no torch/NVML (orchestration only, step 3 skipped)")
    a = ap.parse_args()
    if a.fake:
        os.environ["WEIGHTS_FAKE"] = "1"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)  # the scene's own directory
    WORK.mkdir(parents=True)
    os.chmod(WORK, 0o755)
    (WORK / "times").mkdir()
    os.chmod(WORK / "times", 0o1777)
    model = WORK / "model"
    res: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "user": a.user}
    ngpu = len(bw.nvml())
    res["idle"] = bw.nvml()
    name = longest_name(WORK / "run")
    res["name"] = name
    holder = engine = None
    try:
        res["weights"] = bw.make_weights(model, a.gib, 120)
        for path in [model, *model.iterdir()]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        hport = free_port()
        preload = ["preload", "--model", str(model), "-tp", str(ngpu)]
        weights = {"health_port": hport}
        # 1. names
        long_cfg = write_config(
            WORK / "long.weights.toml",
            sections(
                WORK, name + "y", a.user, a.python, model, preload, deployment={"role": "weights"}, weights=weights
            ),
        )
        dry = dry_run(long_cfg)
        res["too_long"] = {"rc": dry.returncode, "out": (dry.stdout + dry.stderr)[-600:]}
        bw.expect(
            f"a {len(name) + 1}-character name is refused at load (78, 108 > 107)",
            dry.returncode == 78 and "108 bytes" in dry.stderr + dry.stdout,
            res["too_long"]["out"][-300:],
        )
        # 2. the holder as USER
        holder_cfg = write_config(
            WORK / f"{name}.weights.toml",
            sections(WORK, name, a.user, a.python, model, preload, deployment={"role": "weights"}, weights=weights),
        )
        holder = bw.Sup(holder_cfg, WORK, "holder")
        t_ready = holder.ready(900)
        res["holder_ready_s"] = t_ready - holder.t0
        sockets = WORK / "run" / name / SOCKET_DIR_NAME
        listing = sorted(sockets.iterdir())
        res["sockets"] = [(str(p), len(str(p)), p.stat().st_uid) for p in listing]
        uid = pwd.getpwnam(a.user).pw_uid
        bw.expect(
            f"holder as {a.user}: READY, {ngpu} socket(s) of <= 107 bytes owned by {a.user}",
            len(listing) == ngpu and all(n <= 107 and u == uid for _, n, u in res["sockets"]),
            str(res["sockets"]),
        )
        # 3. the memory rule near the limit
        daemons, silent = allocated(sockets)
        res["daemons_allocated"], res["daemons_silent"] = daemons, silent
        now = bw.nvml()
        res["holder_loaded"] = now
        if not a.fake:
            import pynvml

            pynvml.nvmlInit()
            totals = {
                i: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total >> 20 for i in range(ngpu)
            }
            pynvml.nvmlShutdown()
            rows = []
            for i in range(ngpu):
                u_h = sum(mib for pid, mib in now[i]["procs"].items() if pid in daemons)
                a_h = sum(daemons[pid] >> 20 for pid in now[i]["procs"] if pid in daemons)
                free = totals[i] - now[i]["used_mib"]
                rows.append({"gpu": i, "total": totals[i], "free": free, "nvml_holder": u_h, "allocated": a_h})
            res["memory"] = rows
            tight = min(rows, key=lambda r: (r["free"] + r["allocated"]) / r["total"])
            u_vllm = min((r["free"] + r["allocated"]) / r["total"] for r in rows)
            u_nvml = min((r["free"] + r["nvml_holder"]) / r["total"] for r in rows)
            u_fail = math.floor((u_vllm + u_nvml) / 2 * 1e4) / 1e4
            u_ok = math.floor((tight["free"] + tight["allocated"] - 1024) / tight["total"] * 1e4) / 1e4
            res["utilisation"] = {"vllm_limit": u_vllm, "nvml_limit": u_nvml, "fail": u_fail, "ok": u_ok}
            bw.expect(
                "NVML shows more for the holder than its allocator holds (the credit's difference)",
                u_vllm < u_fail < u_nvml,
                json.dumps(res["utilisation"]),
            )
            fail_cfg = engine_config(f"{name}.fail.toml", name, a.user, a.python, model, ngpu, u_fail, 60)
            dry = dry_run(fail_cfg)
            res["preflight_fail"] = {"rc": dry.returncode, "out": dry.stdout[-1500:]}
            bw.expect(
                f"at {u_fail} the engine's preflight refuses (gpu_memory_fraction, exit 10)",
                dry.returncode == 10 and "gpu_memory_fraction" in dry.stdout,
                dry.stdout[-400:],
            )
            standin = subprocess.run(
                [a.python, str(bw.VLLM), *engine_argv(name, model, ngpu, free_port(), u_fail, WORK)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd="/",
                **as_user(a.user),
                env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            res["vllm_rule_fail"] = {"rc": standin.returncode, "out": (standin.stdout + standin.stderr)[-800:]}
            bw.expect(
                f"at {u_fail} vLLM's rule refuses too (the stand-in's request_memory)",
                standin.returncode != 0 and "Free memory on device" in standin.stdout + standin.stderr,
                res["vllm_rule_fail"]["out"][-300:],
            )
        else:
            u_ok = 0.5
        ok_cfg = engine_config(f"{name}.toml", name, a.user, a.python, model, ngpu, u_ok, 60)
        engine = bw.Sup(ok_cfg, WORK, "engine")
        t_engine = engine.ready(300)
        res["engine_ready_s"] = t_engine - engine.t0
        times = bw.engine_times(WORK, engine.child())
        res["engine_times"] = times
        bw.expect(
            f"at {u_ok} the engine as {a.user} passes its preflight and maps the held weights to READY",
            str(times.get("mode", "")).startswith("ipc_cache"),
            json.dumps(times)[:300],
        )
        # 4. stop the engine
        rc, took = engine.stop()
        engine = None
        bw.expect(
            "the engine's stop: exit 0, the holder still serving",
            rc == 0 and holder.run.proc.poll() is None,
            f"rc {rc} in {took:.1f} s",
        )
        # 5. another user, while the holder serves alone
        if a.user != "root":
            root_cfg = engine_config(f"{name}.root.toml", name, "root", a.python, model, ngpu, u_ok, 20)
            other = bw.Sup(root_cfg, WORK, "engine-root")
            rc = other.run.wait(300)
            res["other_user"] = {"rc": rc, "tail": other.tail()}
            bw.expect(
                f"an engine as root beside a holder as {a.user} is refused, never READY (item 1; the daemon "
                "rejects a root peer by SO_PEERCRED anyway)",
                rc != 0 and other.run.notify.first("READY", "1") is None,
                f"rc {rc}: {other.tail()[-300:]}",
            )
        rc, took = holder.stop()
        holder = None
        idle = max(v["used_mib"] for v in res["idle"].values())
        ok, _, now_mib = bw.wait_freed(idle + 200, 60)
        bw.expect(
            "the holder's stop: exit 0 (its vllm preload exits 241 on SIGTERM), GPU memory back",
            rc == 0 and ok,
            f"rc {rc} in {took:.1f} s, {now_mib} MiB",
        )
    except Exception as exc:  # the scene reports what it reached, whatever stopped it
        bw.expect("the scene ran to its end", False, f"{type(exc).__name__}: {exc}")
    finally:
        for sup in (engine, holder):
            if sup is not None:
                sup.stop()
        bw.cleanup()
    return scene_report(out, "holder_scene", "Holder scene (issue 38)", res, bw.CHECKS)


if __name__ == "__main__":
    sys.exit(main())
