"""docs/spare.md: the holder's, the engine's and the spare's GPU memory are the deployment's own in each one's
preflight (never busy, never reaped); the spare's dry run adds them up per GPU and refuses a plan that does not fit,
naming the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kimi_supervisor.config.load import load_config
from kimi_supervisor.config.model import Config, SpareConfig
from kimi_supervisor.deployment.choose import for_config
from kimi_supervisor.host.gpu import MIB, GpuMemory
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.memory_plan import plan
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.roles import Role
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import short_link
from tests.conftest import REPO
from tests.preflight.test_holder_memory import fake_vllm_script, holder_supervisor, stop

HELD_MIB = 60000  # the weights, one copy, the holder's
ENGINE_MIB = 25000  # the engine's KV cache, context and graphs
SPARE_MIB = 8000  # the spare's own


def write_pair(tmp_path: Path, engine_kv: str | None = None, spare_kv_gib: int = 4) -> tuple[Path, Path]:
    run = short_link(tmp_path / "run")
    sockets = run / "kimi" / "weight-cache"
    extra = json.dumps({"socket_dir": str(sockets), "mode": "zero_copy", "fallback": False})
    argv = ["vllm", "serve", str(tmp_path), "-tp", "1", "--uds", str(run / "kimi" / "front" / "engine.sock")]
    argv += ["--load-format", "ipc_cache", "--model-loader-extra-config", extra, "--gpu-memory-utilization", "0.9"]
    argv += ["--kv-cache-memory-bytes", engine_kv] if engine_kv else []
    (tmp_path / "shm").mkdir(exist_ok=True)
    common = (
        f'[paths]\nruntime_directory = "{run}"\nstate_directory = "{tmp_path / "lib"}"\n'
        "[preflight]\ndeadline_s = 5\npoll_interval_s = 1\ncheck_model = false\nmemory_threshold_mib = 1024\n"
        f'[preflight.shm]\ndirectory = "{tmp_path / "shm"}"\n'
    )
    engine = tmp_path / "kimi.toml"
    engine.write_text(
        f'[deployment]\nname = "kimi"\n{common}[child]\nargv = {json.dumps(argv)}\n[weights]\nholder = true\n'
    )
    spare = tmp_path / "kimi.spare.toml"
    spare.write_text(
        f'[deployment]\nname = "kimi"\nrole = "spare"\n{common}'
        f"[spare]\nkv_cache_memory_bytes = {spare_kv_gib << 30}\ngpu_memory_utilization = 0.1\n"
    )
    return engine, spare


def partner_supervisor(tmp_path: Path, suffix: str) -> tuple[subprocess.Popen[bytes], int]:
    """A root process that looks like kimi-supervisor, holds deployment kimi's locks under `suffix` through the real
    code and runs a `vllm serve` child, as the engine's or the spare's supervisor does: (supervisor, child PID)."""
    script = fake_vllm_script(tmp_path)
    code = (
        "import subprocess, sys, time\nfrom pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
        f"held = instance_lock.Resources(Path({str(short_link(tmp_path / 'run'))!r}), (0,), None, 'kimi', "
        f"suffix={suffix!r})\n"
        "lock = instance_lock.acquire(held, 'kimi.toml')\n"
        f"child = subprocess.Popen([{sys.executable!r}, {str(script)!r}, 'serve', '/m'], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\nprint(child.pid, flush=True)\ntime.sleep(600)\n"
    )
    argv = ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config x.toml', code]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHOME": sys.base_prefix}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def preflight(cfg: Config, occupants: dict[int, int | None], dry_run: bool) -> dict[str, object]:
    probe = FakeGpuProbe([FakeGpu(occupants=occupants)])
    log = RecordingLog()
    report = Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=dry_run)
    assert not log.events("preflight.kill")
    return {c.name: c for c in report.checks} | {"proceed": report.proceed}


def test_the_engines_memory_is_the_spares_own_and_the_spares_the_engines(tmp_path: Path) -> None:
    engine_path, spare_path = write_pair(tmp_path)
    holder, held = holder_supervisor(tmp_path, allocated_mib=HELD_MIB)
    engine, engine_child = partner_supervisor(tmp_path, Role.ENGINE.file_suffix)
    try:
        spare_cfg = load_config(spare_path)
        checks = preflight(spare_cfg, {held: HELD_MIB, engine_child: ENGINE_MIB}, dry_run=False)
        assert checks["proceed"] and checks["gpu_wait"].verdict.value == "ok"  # type: ignore[attr-defined]
        partner = checks["partner_memory"]
        assert f"holds GPU 0: {ENGINE_MIB} MiB: counted as this deployment's own" in partner.message  # type: ignore[attr-defined]
        assert os.path.exists(f"/proc/{engine_child}") and os.path.exists(f"/proc/{held}")
        # The plan counts the live holder's weights as NVML shows them.
        assert "weights 60000 MiB (the live holder, NVML)" in checks["memory_plan"].message  # type: ignore[attr-defined]
    finally:
        stop(engine)
    spare, spare_child = partner_supervisor(tmp_path, Role.SPARE.file_suffix)
    try:
        checks = preflight(load_config(engine_path), {held: HELD_MIB, spare_child: SPARE_MIB}, dry_run=False)
        assert checks["proceed"] and checks["gpu_wait"].verdict.value == "ok"  # type: ignore[attr-defined]
        assert f"GPU 0: {SPARE_MIB} MiB" in checks["partner_memory"].message  # type: ignore[attr-defined]
        assert "memory_plan" not in checks  # the engine's config has no [spare]: the spare's dry run plans
        # The engine's stop does not wait for the holder's or the spare's memory to be freed: both are its own.
        engine_cfg = load_config(engine_path)
        probe = FakeGpuProbe([FakeGpu(occupants={held: HELD_MIB, spare_child: SPARE_MIB})])
        role = for_config(engine_cfg)
        assert role.own_memory(engine_cfg, PsutilProcessTable(), probe, (0,)) == {0: HELD_MIB + SPARE_MIB}  # type: ignore[attr-defined]
    finally:
        stop(spare)
        stop(holder)


def test_a_dead_partners_tree_is_busy_like_anyone_elses(tmp_path: Path) -> None:
    """Its supervisor gone, the engine's tree is no longer the deployment's: the spare's preflight waits for it (and
    the reaper may take it, as any stale vLLM)."""
    _engine_path, spare_path = write_pair(tmp_path)
    holder, held = holder_supervisor(tmp_path, allocated_mib=HELD_MIB)
    try:
        checks = preflight(load_config(spare_path), {held: HELD_MIB, 4_194_401: ENGINE_MIB}, dry_run=True)
        assert "partner_memory" not in checks
        assert checks["gpu_wait"].verdict.value == "would wait"  # type: ignore[attr-defined]
    finally:
        stop(holder)


def spare_numbers(**kw: object) -> SpareConfig:
    return SpareConfig(Path("/etc/k/kimi.toml"), 4 << 30, 0.1, **kw)  # type: ignore[arg-type]


def test_the_plan_names_each_share_and_refuses_what_does_not_fit() -> None:
    gpu = GpuMemory(0, total_mib=97887, used_mib=0, free_mib=97887)
    fits = plan([gpu], {0: 60000}, "the live holder, NVML", spare_numbers(engine_gpu_memory_utilization=0.85))
    # engine: 0.85 x 97887 - 60000 = 23203; spare: 4096 + 4096; margin 1024; 92419 of 97887.
    assert fits.verdict.value == "ok", fits.message
    assert fits.data["gpus"] == [  # type: ignore[index]
        {
            "gpu": 0,
            "total_mib": 97887,
            "weights_mib": 60000,
            "engine_mib": 23203,
            "spare_mib": 8192,
            "margin_mib": 1024,
            "left_mib": 5468,
        }
    ]
    short = plan([gpu], {0: 60000}, "the live holder, NVML", spare_numbers(engine_gpu_memory_utilization=0.92))
    assert short.blocking
    assert short.message == (
        "the weights, the engine and the spare do not fit: GPU 0: weights 60000 MiB (the live holder, NVML) + "
        "engine 30056 MiB (its --gpu-memory-utilization 0.92 x total - weights) + spare 8192 MiB (KV 4096 + "
        "overhead 4096) + margin 1024 MiB = 99272 of 97887 MiB: lower spare.kv_cache_memory_bytes or the engine's "
        "--gpu-memory-utilization"
    )
    by_bytes = plan([gpu], {0: 60000}, "w", spare_numbers(engine_kv_cache_memory_bytes=20 * 1024 * MIB))
    assert by_bytes.data["gpus"][0]["engine_mib"] == 20 * 1024 + 4096  # type: ignore[index]


def test_the_spares_dry_run_refuses_a_plan_that_does_not_fit(tmp_path: Path) -> None:
    """Without a live holder, the weights' share is the checkpoint's files over its GPUs."""
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model-00001-of-00001.safetensors", 70000 * MIB)  # sparse: no disk used
    _engine, spare_path = write_pair(tmp_path, spare_kv_gib=16)
    checks = preflight(load_config(spare_path), {}, dry_run=True)
    plan_check = checks["memory_plan"]
    assert not checks["proceed"] and plan_check.blocking  # type: ignore[attr-defined]
    assert "weights 70000 MiB (the checkpoint's files / GPUs)" in plan_check.message  # type: ignore[attr-defined]
