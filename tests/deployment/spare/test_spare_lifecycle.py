"""The hot spare's run (docs/spare.md), real supervisors around the fake vLLM: the holder, the engine and the spare of
one deployment side by side; the spare waits for the holder, serves its engine's argv on its own socket, outlives the
engine's stop, refuses a second spare (16) and drains on its own stop like any engine."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.roles import Role
from testkit.harness import Run, fake_tree_of, weights_pair
from tests.conftest import wait_for


def own(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir(exist_ok=True)
    return tmp_path / name


def health(sock: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return s.recv(64)


def test_the_spare_serves_its_engines_argv_on_its_own_socket_beside_the_engine_and_outlives_its_stop(
    tmp_path: Path,
) -> None:
    engine_sock = Path(tempfile.mkdtemp(prefix="ksp-", dir="/tmp")) / "engine.sock"
    holder_cfg, engine_cfg = weights_pair(tmp_path, engine_args=["--uds", str(engine_sock)])
    spare_cfg = tmp_path / "kimi.spare.toml"
    sections = (
        '[deployment]\nname = "kimi"\nrole = "spare"\n'
        "[spare]\nkv_cache_memory_bytes = 1073741824\ngpu_memory_utilization = 0.2\n"
        "[readiness]\nstall_timeout_s = 20\ndeadline_s = 60\npoll_interval_s = 0.1\n"
        "[health]\ninterval_s = 0.3\ntimeout_s = 1\nfailures_tolerated = 3\n"
        "[shutdown]\ngrace_s = 3\ngpu_release_timeout_s = 0\n"
        f'[preflight]\ncheck_model = false\n[preflight.shm]\ndirectory = "{tmp_path / "shm"}"\n'
    )
    spare_cfg.write_text(sections)
    derived = load_config(spare_cfg)
    assert derived.child.vllm.uds is not None
    spare_sock = Path(derived.child.vllm.uds)
    holder = engine = spare = None
    try:
        spare = Run(spare_cfg, own(tmp_path, "s"))
        assert "no weight holder" in spare.wait_event("weights.waiting", timeout=20)["why"]  # it waits, as the engine
        holder = Run(holder_cfg, own(tmp_path, "h"))
        holder.wait_event("state.ready", timeout=30)
        engine = Run(engine_cfg, own(tmp_path, "e"))
        engine.wait_event("state.ready", timeout=30)
        spare.wait_event("state.ready", timeout=30)
        assert health(engine_sock).startswith(b"HTTP/1.1 200") and health(spare_sock).startswith(b"HTTP/1.1 200")
        state = tmp_path / "run" / "kimi" / Role.SPARE.state_file_name
        wait_for(lambda: json.loads(state.read_text())["phase"] == "ready", timeout=10)
        # Both record what decides their tokens: the same key, which the front compares (docs/spare.md).
        engine_state = json.loads((tmp_path / "run" / "kimi" / Role.ENGINE.state_file_name).read_text())
        assert json.loads(state.read_text())["output_key"] == engine_state["output_key"]
        # A second spare of the deployment: its locks are taken, nothing changed.
        second = Run(spare_cfg, own(tmp_path, "s2"))
        assert second.wait(30) == ExitCode.ANOTHER_INSTANCE
        # The engine's stop (a planned restart) leaves the spare serving.
        engine.signal()
        assert engine.wait(30) == ExitCode.OK
        assert spare.proc.poll() is None and health(spare_sock).startswith(b"HTTP/1.1 200")
        spare.signal()
        assert spare.wait(30) == ExitCode.OK
        assert (tmp_path / "state" / "kimi" / Role.SPARE.history_file_name).exists()
        assert holder.proc.poll() is None and fake_tree_of(f"{tmp_path}/holder")
    finally:
        for run in (spare, engine, holder):
            if run is not None and run.proc.poll() is None:
                run.signal()
                run.wait(30)
