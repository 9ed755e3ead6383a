"""docs/weight-holder.md: the deployment's holder is its own, not stale; an orphaned one is stale like any other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.host.gpu import MIB
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.reaper import plan_reap
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.roles import Role
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import short_link
from testkit.procutil import free_port
from tests.conftest import REPO, ProcSpawner, wait_for

HELD_MIB = 70000  # of an RTX PRO 6000's 97887: above 1 - 0.9 of it free, so the fraction fails unless counted


def engine_cfg(tmp_path: Path, holder: bool = True, tp: int = 2, threshold: int = 1024) -> Config:
    run = short_link(tmp_path / "run")  # vLLM's socket paths under it must fit a Unix socket
    sockets = run / "kimi" / "weight-cache"
    extra = json.dumps({"socket_dir": str(sockets), "mode": "zero_copy", "fallback": False})
    argv = ["vllm", "serve", str(tmp_path), "-tp", str(tp), "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--load-format", "ipc_cache", "--model-loader-extra-config", extra, "--gpu-memory-utilization", "0.9"]
    (tmp_path / "shm").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "child": {"argv": argv},
        "deployment": {"name": "kimi"},
        "paths": {"runtime_directory": str(run), "state_directory": str(tmp_path / "lib")},
        "preflight": {
            "deadline_s": 5,
            "poll_interval_s": 1,
            "check_model": False,
            "memory_threshold_mib": threshold,
        },
        "weights": {"holder": holder},
    }
    data["preflight"]["shm"] = {"directory": str(tmp_path / "shm")}
    return parse_config(data, tmp_path / "kimi.toml")


def fake_vllm_script(tmp_path: Path) -> Path:
    """A console script named vllm: `python3 .../vllm preload ...` is the holder's command line."""
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir(exist_ok=True)
    script.write_text(DAEMON)
    return script


# What the holder's daemon answers to vLLM's get_memory (daemon.py:419-426), on a socket named as vLLM names it,
# when KIMI_TEST_SOCKETS is set: KIMI_TEST_ALLOCATED bytes, its PyTorch allocator's share of what NVML shows.
DAEMON = """
import os, pickle, socket, struct, threading, time
LEN = struct.Struct("!Q")
def serve(server, nbytes):
    while True:
        conn, _ = server.accept()
        with conn:
            (n,) = LEN.unpack(conn.recv(8, socket.MSG_WAITALL))
            request = pickle.loads(conn.recv(n, socket.MSG_WAITALL))
            ok = request.get("cmd") == "get_memory"
            body = pickle.dumps({"status": "ok", "memory_bytes": nbytes} if ok else {"status": "error"})
            conn.sendall(LEN.pack(len(body)) + body)
sockets = os.environ.get("KIMI_TEST_SOCKETS")
if sockets:
    os.makedirs(sockets, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(os.path.join(sockets, "vllm_weight_cache_" + "0" * 32 + ".sock"))
    server.listen()
    threading.Thread(target=serve, args=(server, int(os.environ["KIMI_TEST_ALLOCATED"])), daemon=True).start()
print("up", flush=True)
time.sleep(600)
"""


def holder_supervisor(
    tmp_path: Path, deployment: str = "kimi", allocated_mib: int | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """A root process that looks like kimi-supervisor, holds the deployment's `.weights` locks through the real
    code and runs a `vllm preload` child, as the holder's supervisor does: (supervisor, holder child PID)."""
    script = fake_vllm_script(tmp_path)
    code = (
        "import subprocess, sys, time\nfrom pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
        f"held = instance_lock.Resources(Path({str(tmp_path / 'run')!r}), (0, 1), 8099, {deployment!r}, "
        f"suffix={Role.WEIGHTS.file_suffix!r})\n"
        "lock = instance_lock.acquire(held, 'kimi.weights.toml')\n"
        f"child = subprocess.Popen([{sys.executable!r}, {str(script)!r}, 'preload', '--model', '/m'],\n"
        "    stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\nprint(child.pid, flush=True)\ntime.sleep(600)\n"
    )  # fmt: skip
    argv = ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config x.toml', code]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHOME": sys.base_prefix}
    if allocated_mib is not None:
        env["KIMI_TEST_SOCKETS"] = str(short_link(tmp_path / "run") / deployment / "weight-cache")
        env["KIMI_TEST_ALLOCATED"] = str(allocated_mib * MIB)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def test_live_holders_memory_is_the_engines_own_and_its_tree_is_spared(tmp_path: Path) -> None:
    supervisor, child = holder_supervisor(tmp_path, allocated_mib=2 * HELD_MIB)
    try:
        cfg = engine_cfg(tmp_path)
        probe = FakeGpuProbe([FakeGpu(occupants={child: HELD_MIB}), FakeGpu(occupants={child: HELD_MIB})])
        log = RecordingLog()
        report = Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=False)
        assert report.proceed
        by_name = {c.name: c for c in report.checks}
        assert by_name["gpu_wait"].verdict.value == "ok"
        assert by_name["gpu_memory_fraction"].verdict.value == "ok"
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
        probe = FakeGpuProbe([FakeGpu(occupants={orphan.pid: HELD_MIB, live_child: HELD_MIB})])
        plan = plan_reap(probe.processes(0), PsutilProcessTable(), cfg.preflight.reap, os.getpid(), {supervisor.pid})
        assert [v.proc.pid for v in plan.victims] == [orphan.pid]
        assert [(s.pid, s.reason) for s in plan.spared] == [
            (live_child, f"descends from a live kimi-supervisor (PID {supervisor.pid})")
        ]
    finally:
        stop(supervisor)
    # Its supervisor gone (SIGKILLed with its group here): the holder it left would be stale too.
    wait_for(lambda: not os.path.exists(f"/proc/{live_child}"))


NVML_MIB = 20000  # what NVML shows for the holder's daemon on the GPU
ALLOCATED_MIB = 19000  # of it, its PyTorch allocations; the rest is its CUDA context, NCCL and cached blocks
NEED_MIB = int(0.9 * 97887)  # the engine's --gpu-memory-utilization 0.9 of an RTX PRO 6000


@pytest.mark.parametrize(
    ("free_mib", "proceeds"), [(NEED_MIB - ALLOCATED_MIB, True), (NEED_MIB - ALLOCATED_MIB - 1, False)]
)
def test_only_what_vllm_subtracts_is_credited_at_the_limit(tmp_path: Path, free_mib: int, proceeds: bool) -> None:
    """vLLM's request_memory (v1/worker/utils.py:716-768) needs free >= total x util - the daemons' PyTorch
    allocations (their get_memory answer), not - what NVML shows for them: one MiB short of that, the preflight
    refuses, as vLLM would; crediting NVML's 20000 MiB would pass 1000 MiB short."""
    supervisor, child = holder_supervisor(tmp_path, allocated_mib=ALLOCATED_MIB)
    try:
        others = 97887 - NVML_MIB - free_mib  # held by others below the (raised) threshold: not waited for
        cfg = engine_cfg(tmp_path, tp=1, threshold=others)
        probe = FakeGpuProbe([FakeGpu(base_used_mib=others, occupants={child: NVML_MIB})])
        report = Preflight(cfg, probe, PsutilProcessTable(), FakeClock(), RecordingLog()).run(dry_run=True)
        by_name = {c.name: c for c in report.checks}
        assert (by_name["gpu_memory_fraction"].verdict.value == "ok") is proceeds, by_name["gpu_memory_fraction"]
        assert by_name["weights_memory"].data["credited_mib_by_gpu"] == {"0": ALLOCATED_MIB}
        if not proceeds:
            assert f"GPU 0: {NEED_MIB - 1} MiB free < {NEED_MIB} MiB" in by_name["gpu_memory_fraction"].message
    finally:
        stop(supervisor)
