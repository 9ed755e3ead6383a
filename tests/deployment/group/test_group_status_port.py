"""A group node's status port is its own before the preflight (docs/multi-node.md): taken by another user's listener or
by a second group deployment on the host, the start is exit 16 naming the holder, never 70 (a crash loop)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from kimi_supervisor.exitcodes import ExitCode
from testkit.harness import FAKE, Run, fake_sections, free_port, write_config

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def follower_config(base: Path, deployment: str, status_port: int) -> Path:
    """A follower whose leader never comes: it binds its status port and waits (nothing is spawned)."""
    base.mkdir(parents=True, exist_ok=True)
    sections: dict[str, Any] = fake_sections(base)
    argv = [sys.executable, str(FAKE), "serve", str(base / "model"), "--port", str(free_port()), "-tp", "2"]
    sections["child"] = {"argv": argv, "env": {"KIMI_TEST_MARKER": str(base)}}
    sections["deployment"] = {"name": deployment, "role": "follower"}
    sections["cluster"] = {
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "status_address": "127.0.0.1",
        "status_port": status_port,
        "leader_status_url": f"http://127.0.0.1:{free_port()}/",
        "leader_wait_s": 600,
    }
    return write_config(base / f"{deployment}.toml", sections)


def test_a_second_group_deployment_on_the_same_status_port_is_16_naming_the_first(tmp_path: Path) -> None:
    port = free_port()
    first_cfg = follower_config(tmp_path / "a", "alpha", port)
    second_cfg = follower_config(tmp_path / "b", "beta", port)
    # Both deployments' locks in one host-wide directory, as on a real host (each has its own state files).
    text = second_cfg.read_text().replace(str(tmp_path / "b" / "run"), str(tmp_path / "a" / "run"))
    second_cfg.write_text(text)
    first = Run(first_cfg, tmp_path / "a")
    try:
        first.wait_event("group.waiting")
        second = Run(second_cfg, tmp_path / "b")
        assert second.wait(timeout=120) == ExitCode.ANOTHER_INSTANCE, second.raw_stderr[-10:]
        exit_event = second.event("supervisor.exit")
        assert exit_event is not None
        assert f"another kimi-supervisor (PID {first.proc.pid}) owns status port {port}" in exit_event["error"]
        assert first.proc.poll() is None
    finally:
        first.signal()
        assert first.wait() == 0


def test_another_users_listener_on_the_status_port_is_16_naming_it(tmp_path: Path) -> None:
    port = free_port()
    code = (
        "import socket, sys\ns = socket.socket()\n"
        f"s.bind(('127.0.0.1', {port}))\ns.listen()\nprint('listening', flush=True)\nsys.stdin.read()\n"
    )
    # The system's python: nobody cannot enter the test's own interpreter's home (/root is 0700).
    squatter = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", code], user=NOBODY, group=NOBODY, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/"
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"listening\n"
        run = Run(follower_config(tmp_path / "a", "alpha", port), tmp_path / "a")
        assert run.wait(timeout=120) == ExitCode.ANOTHER_INSTANCE, run.raw_stderr[-10:]
        exit_event = run.event("supervisor.exit")
        assert exit_event is not None
        assert (
            f"the status endpoint's 127.0.0.1:{port} (cluster.status_port) is taken by PID {squatter.pid} "
            in (exit_event["error"])
        )
        assert "uid 65534" in exit_event["error"]
    finally:
        squatter.kill()
        squatter.wait()
