"""Issue 26: the deployment's weight holder is its own, not stale; an orphaned one is stale like any other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.reaper import plan_reap
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock, RecordingLog
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.procutil import free_port
from tests.conftest import REPO, ProcSpawner, wait_for

HELD_MIB = 70000  # of an RTX PRO 6000's 97887: above 1 - 0.9 of it free, so the fraction fails unless counted


def engine_cfg(tmp_path: Path, holder: bool = True) -> Config:
    sockets = tmp_path / "run" / "kimi" / "weight-cache"
    extra = json.dumps({"socket_dir": str(sockets), "mode": "zero_copy", "fallback": False})
    argv = ["vllm", "serve", str(tmp_path), "-tp", "2", "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--load-format", "ipc_cache", "--model-loader-extra-config", extra]
    (tmp_path / "shm").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "child": {"argv": argv},
        "deployment": {"name": "kimi"},
        "paths": {"runtime_directory": str(tmp_path / "run"), "state_directory": str(tmp_path / "lib")},
        "preflight": {"deadline_s": 5, "poll_interval_s": 1, "check_model": False},
        "weights": {"holder": holder},
    }
    data["preflight"]["shm"] = {"directory": str(tmp_path / "shm")}
    return parse_config(data, tmp_path / "kimi.toml")


def fake_vllm_script(tmp_path: Path) -> Path:
    """A console script named vllm: `python3 .../vllm preload ...` is the holder's command line."""
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    return script


def holder_supervisor(tmp_path: Path, deployment: str = "kimi") -> tuple[subprocess.Popen[bytes], int]:
    """A root process that looks like kimi-supervisor, holds the deployment's `.weights` locks through the real
    code and runs a `vllm preload` child, as the holder's supervisor does: (supervisor, holder child PID)."""
    script = fake_vllm_script(tmp_path)
    code = (
        "import subprocess, sys, time\nfrom pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
        f"lock = instance_lock.acquire(Path({str(tmp_path / 'run')!r}), [0, 1], 8099, 'kimi.weights.toml', "
        f"deployment={deployment!r}, suffix=instance_lock.WEIGHTS_SUFFIX)\n"
        f"child = subprocess.Popen([{sys.executable!r}, {str(script)!r}, 'preload', '--model', '/m'],\n"
        "    stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\nprint(child.pid, flush=True)\ntime.sleep(600)\n"
    )  # fmt: skip
    argv = ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config x.toml', code]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHOME": sys.base_prefix}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def test_live_holders_memory_is_the_engines_own_and_its_tree_is_spared(tmp_path: Path) -> None:
    supervisor, child = holder_supervisor(tmp_path)
    try:
        cfg = engine_cfg(tmp_path)
        probe = FakeGpuProbe([FakeGpu(holders={child: HELD_MIB}), FakeGpu(holders={child: HELD_MIB})])
        log = RecordingLog()
        report = Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=False)
        assert report.proceed
        by_name = {c.name: c for c in report.checks}
        assert by_name["gpu_wait"].status.value == "ok"
        assert by_name["gpu_memory_fraction"].status.value == "ok"
        held = by_name["weights_memory"]
        assert held.message.startswith(
            f"the weight holder of deployment kimi (supervisor PID {supervisor.pid}) holds GPU 0: {HELD_MIB} MiB, "
            f"GPU 1: {HELD_MIB} MiB: counted as this deployment's own"
        )
        assert not log.events("preflight.kill") and os.path.exists(f"/proc/{child}")
        # An engine that does not map the holder's weights counts them as anyone's: it waits, then fails.
        plain = Preflight(engine_cfg(tmp_path, holder=False), probe, PsutilProcessTable(), FakeClock(), log)
        report = plain.run(dry_run=True)
        assert "weights_memory" not in {c.name for c in report.checks} and not report.proceed
    finally:
        stop(supervisor)


def test_an_orphaned_holder_is_stale_like_any_other(tmp_path: Path, spawner: ProcSpawner) -> None:
    script = fake_vllm_script(tmp_path)
    orphan = spawner.start([sys.executable, str(script), "preload", "--model", "/m", "-tp", "2"])
    assert orphan.stdout is not None and orphan.stdout.readline() == b"up\n"
    supervisor, live_child = holder_supervisor(tmp_path)
    try:
        cfg = engine_cfg(tmp_path)
        probe = FakeGpuProbe([FakeGpu(holders={orphan.pid: HELD_MIB, live_child: HELD_MIB})])
        plan = plan_reap(probe.processes(0), PsutilProcessTable(), cfg.preflight.reap, os.getpid(), {supervisor.pid})
        assert [v.proc.pid for v in plan.victims] == [orphan.pid]
        assert [(s.pid, s.reason) for s in plan.spared] == [
            (live_child, f"descends from a live kimi-supervisor (PID {supervisor.pid})")
        ]
    finally:
        stop(supervisor)
    # Its supervisor gone (SIGKILLed with its group here): the holder it left would be stale too.
    wait_for(lambda: not os.path.exists(f"/proc/{live_child}"))
