"""The weight holder's /health port is checked before the spawn, as an engine's API port is (docs/weight-holder.md)."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import ExitCode, PreflightError
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import short_link
from testkit.procutil import free_port


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@pytest.fixture
def squatter() -> Iterator[int]:
    """Something else on 127.0.0.1:PORT answering 200 to every GET /health."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Ok)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_holder_refuses_a_health_port_someone_else_answers_on(tmp_path: Path, squatter: int) -> None:
    run = short_link(tmp_path / "run")
    data = {
        "child": {"argv": ["vllm", "preload", "--model", str(tmp_path)]},
        "deployment": {"name": "kimi", "role": "weights"},
        "weights": {"health_port": squatter},
        "paths": {"runtime_directory": str(run), "state_directory": str(tmp_path / "state")},
        "preflight": {"gpus": [], "check_model": False, "shm": {"enabled": False}},
    }
    cfg = parse_config(data, tmp_path / "kimi.weights.toml")
    with pytest.raises(PreflightError) as info:
        Preflight(cfg, FakeGpuProbe([]), PsutilProcessTable(), FakeClock(), RecordingLog()).run(dry_run=False)
    assert info.value.exit_code == ExitCode.PREFLIGHT_FAILED
    assert f"port: port {squatter} on 127.0.0.1 is already in use by PID {os.getpid()}" in info.value.message
