"""The unit file: packaging/ is the rendered template; systemd-analyze verify accepts it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config.load import DEFAULT_PATH, parse_config
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.systemd import unit

REPO = Path(__file__).resolve().parents[2]
PACKAGED = REPO / "packaging" / "systemd" / "kimi-supervisor.service"


def test_packaged_unit_is_the_rendered_template() -> None:
    assert PACKAGED.read_text() == unit.render()


def directives(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = " ".join(value.split())
    return out


# Not configurable: the supervisor's wait after SIGKILL, and what vLLM's workers take to shut down.
SIGKILL_WAIT_S = 5
VLLM_WORKER_SHUTDOWN_S = 8


def test_unit_directives() -> None:
    d = directives(unit.render())
    assert d["Type"] == "notify" and d["NotifyAccess"] == "main" and d["KillMode"] == "mixed"
    assert d["Restart"] == "on-failure" and d["RestartPreventExitStatus"] == str(int(ExitCode.CONFIG))
    assert d["ExecStart"] == f"{unit.DEFAULT_EXEC} --config {DEFAULT_PATH}"
    defaults = parse_config({"child": {"argv": ["vllm", "serve", "m"]}}, DEFAULT_PATH)
    # systemd must not SIGKILL a stop that is still within what the default config allows it.
    stop = defaults.shutdown
    longest_stop = stop.grace_s + VLLM_WORKER_SHUTDOWN_S + SIGKILL_WAIT_S + stop.gpu_release_timeout_s
    assert int(d["TimeoutStopSec"]) > longest_stop
    # A passing probe must land within every watchdog period (else the supervisor warns watchdog.too_short).
    health = defaults.health
    assert int(d["WatchdogSec"]) > health.interval_s + health.timeout_s
    assert d["LimitMEMLOCK"] == "infinity"
    assert "CAP_KILL" in d["CapabilityBoundingSet"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    path = tmp_path / unit.UNIT_NAME
    path.write_text(unit.render(sys.executable, tmp_path / "k.toml"))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""


def test_install_writes_the_unit(tmp_path: Path) -> None:
    target = unit.install(Path("/etc/kimi-supervisor/kimi-supervisor.toml"), tmp_path, reload=False)
    text = target.read_text()
    assert target == tmp_path / "kimi-supervisor.service"
    assert "--config /etc/kimi-supervisor/kimi-supervisor.toml" in text
    assert (target.stat().st_mode & 0o777) == 0o644


def test_paths_that_systemd_would_mangle_are_quoted() -> None:
    # Before: refused with exit 70 ("a bug"); systemd's own quoting rules express any path.
    d = directives(unit.render(["/opt/my tools/kimi-supervisor"], Path("/etc/k 50%/$x.toml")))
    assert d["ExecStart"] == '"/opt/my tools/kimi-supervisor" --config "/etc/k 50%%/$$x.toml"'


def test_journal_rate_limit_leaves_room_for_the_supervisors_records() -> None:
    """The metered child lines of any rate-limit window (whole seconds it touches) stay under the burst."""
    from kimi_supervisor.child.output import CHILD_LINES_PER_S

    d = directives(unit.render())
    interval = int(d["LogRateLimitIntervalSec"].removesuffix("s"))
    burst = int(d["LogRateLimitBurst"])
    child_max = CHILD_LINES_PER_S * (interval + 1) + (interval + 1)  # lines + one summary a second
    assert burst - child_max >= 10_000  # the supervisor's own records, with room to spare


def test_the_shipped_unit_file_is_the_template() -> None:
    # packaging/ is what operators copy by hand; a hardening line added to one and not the other drifts silently.
    shipped = REPO / "packaging" / "systemd" / unit.UNIT_NAME
    assert shipped.read_text() == unit.render()
