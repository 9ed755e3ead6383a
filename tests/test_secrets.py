"""No secret reaches a log line, a child line we forward, or the dry-run report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.redact import redact_argv, redact_env
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import FAKE, Run, fake_config, free_port
from tests.conftest import ProcSpawner
from tests.preflight.test_preflight import make_cfg

SECRET = "sk-live-5ecret-value"
TOKEN = "hf_T0kenValue1234"


def test_redaction_rules() -> None:
    assert redact_argv(["vllm", "--api-key", SECRET, "--hf-token=" + TOKEN, "--port", "8000"]) == [
        "vllm",
        "--api-key",
        "<redacted>",
        "--hf-token=<redacted>",
        "--port",
        "8000",
    ]
    assert redact_env({"HF_TOKEN": TOKEN, "AWS_SECRET_ACCESS_KEY": "x", "NCCL_PROTO": "LL"}) == {
        "HF_TOKEN": "<redacted>",
        "AWS_SECRET_ACCESS_KEY": "<redacted>",
        "NCCL_PROTO": "LL",
    }


def test_stale_servers_api_key_not_in_dry_run_report(tmp_path: Path, spawner: ProcSpawner) -> None:
    stale = spawner.module("vllm.entrypoints.openai.api_server", ["--api-key", SECRET])
    probe = FakeGpuProbe([FakeGpu(occupants={stale.pid: 4000})])
    report = Preflight(make_cfg(tmp_path, tp=1), probe, PsutilProcessTable(), FakeClock(), RecordingLog()).run(
        dry_run=True
    )
    text = json.dumps(report.to_dict())
    assert "would kill" in text and "--api-key <redacted>" in text
    assert SECRET not in text


def test_no_secret_in_any_supervisor_output(tmp_path: Path) -> None:
    # The child prints its secrets, as vLLM prints its args; the supervisor must not forward them.
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(
        "import os, sys\n"
        "print('non-default args: api_key=' + sys.argv[2] + ' token=' + os.environ['HF_TOKEN'],"
        " flush=True)\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])\n"
    )
    port = free_port()
    argv = [
        sys.executable,
        str(wrapper),
        "--api-key",
        SECRET,
        str(FAKE),
        "serve",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-seconds",
        "0.3",
        "--max-lifetime",
        "60",
    ]
    cfg = fake_config(tmp_path, child={"argv": argv, "env": {"HF_TOKEN": TOKEN, "KIMI_TEST_MARKER": str(tmp_path)}})
    run = Run(cfg, tmp_path)
    run.wait_event("state.ready")
    run.signal()
    assert run.wait() == 0
    lines = [c["line"] for c in run.child_lines]
    assert "non-default args: api_key=<redacted> token=<redacted>" in lines
    everything = json.dumps(run.events) + json.dumps(run.child_lines) + "\n".join(run.raw_stderr)
    assert SECRET not in everything and TOKEN not in everything
    start = run.event("supervisor.start")
    assert start is not None and "--api-key <redacted>" in start["argv"]
