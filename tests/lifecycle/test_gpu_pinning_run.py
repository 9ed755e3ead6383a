"""The child's real environment (docs/configuration.md): a supervisor, fake GPUs, starts the fake vLLM, which prints the
CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and NCCL_RAS_ADDR it got; /proc/PID/environ says the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.fakes.gpu_cli import idle_gpus, write_gpu_file
from testkit.harness import REPO, Run, fake_config
from tests.conftest import wait_for
from tests.host.test_instance_lock import hold_lock

NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_RAS_ADDR")


def gpu_file(tmp_path: Path, count: int) -> Path:
    return write_gpu_file(tmp_path / "gpus.json", idle_gpus(count))


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def printed(run: Run) -> dict[str, str]:
    found = {}
    for c in list(run.child_lines):
        line = str(c.get("line", ""))
        if line.startswith("fake-vllm env ") and "=" in line:
            name, _, value = line.removeprefix("fake-vllm env ").partition("=")
            found[name] = value
    return found


@pytest.mark.parametrize(
    ("gpus", "visible", "ras"), [([2, 3], "2,3", "127.0.0.1:28104"), ("all", "0,1,2,3", "127.0.0.1:28100")]
)
def test_the_child_sees_only_its_gpus_in_pci_bus_order(tmp_path: Path, gpus: object, visible: str, ras: str) -> None:
    fake_args = [a for name in NAMES for a in ("--print-env", name)]
    config = fake_config(tmp_path, fake_args, tp=2, preflight={"gpus": gpus})
    entry = ["-m", "testkit.fakes.gpu_cli", str(gpu_file(tmp_path, 4))]
    # The shell that started the supervisor pinned another GPU, and another order: the child must not inherit it.
    shell = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST", "NCCL_RAS_ADDR": "localhost:28028"}
    run = Run(config, tmp_path, env=shell, entry=entry)
    try:
        run.wait_event("state.ready", timeout=60)
        wait_for(lambda: len(printed(run)) == len(NAMES), timeout=30)
        want = {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_RAS_ADDR": ras}
        assert printed(run) == want
        env = environ_of(run.child_pid)
        assert {k: env.get(k) for k in NAMES} == want
    finally:
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.why()


def test_dry_run_json_shows_the_childs_environment_with_secrets_redacted(tmp_path: Path) -> None:
    config = fake_config(tmp_path, tp=2, preflight={"gpus": "all"}, child={"env": {"HF_TOKEN": "hf_secret_1234"}})
    command = ["-m", "testkit.fakes.gpu_cli", str(gpu_file(tmp_path, 3)), "--config", str(config), "--dry-run"]
    r = subprocess.run(
        [sys.executable, *command, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    env = json.loads(r.stdout)["child_env"]
    assert env == {
        "HF_TOKEN": "<redacted>",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NCCL_RAS_ADDR": "127.0.0.1:28100",
        "CUDA_VISIBLE_DEVICES": "0,1,2",  # "all": every GPU the (fake) NVML sees
    }
    assert "hf_secret_1234" not in r.stdout


def test_the_nccl_ras_port_is_locked_like_the_serving_port(tmp_path: Path) -> None:
    """Another supervisor holding this deployment's RAS port (its own child.env override, say): refused, exit 16,
    before anything is touched."""
    config = fake_config(tmp_path, tp=2, preflight={"gpus": [2, 3]})
    owner = hold_lock(tmp_path / "run", [], 28104)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "testkit.fakes.gpu_cli", str(gpu_file(tmp_path, 4)), "--config", str(config)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            timeout=120,
        )
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert r.returncode == 16, r.stdout + r.stderr
    assert f"another kimi-supervisor (PID {owner.pid}) owns port 28104" in r.stderr
