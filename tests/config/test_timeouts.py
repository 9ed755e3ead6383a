"""The three stop timeouts lined up: --shutdown-timeout, shutdown.grace_s, the unit's TimeoutStopSec."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.checks import Verdict
from kimi_supervisor.cli import entry as cli
from kimi_supervisor.config import timeouts
from kimi_supervisor.config.load import load_config
from kimi_supervisor.systemd import show, unit
from testkit.harness import REPO, fake_config
from tests.cli.test_entry import cli as run_cli
from tests.systemd.test_unit import PACKAGED, directives

SHIPPED = REPO / "etc" / "kimi-supervisor.toml"


def drain_cfg(tmp_path: Path, drain: str | None, grace: float, **shutdown: float) -> Path:
    args = [] if drain is None else (drain.split() if " " in drain else [drain])
    return fake_config(tmp_path, args, shutdown={"grace_s": grace, **shutdown})


@pytest.mark.parametrize(
    ("drain", "grace", "status"),
    [
        (None, 3, Verdict.OK),  # no drain: vLLM aborts in 0.3-0.5 s, any grace does
        ("--shutdown-timeout 30", 44, Verdict.FAIL),
        ("--shutdown-timeout=30", 44.9, Verdict.FAIL),
        ("--shutdown-timeout 30", 45, Verdict.OK),  # exactly 30 + the 15 s margin
        ("--shutdown-timeout=0", 1, Verdict.OK),
    ],
)
def test_grace_must_cover_the_drain(tmp_path: Path, drain: str | None, grace: float, status: Verdict) -> None:
    check = timeouts.check_grace(load_config(drain_cfg(tmp_path, drain, grace)))
    assert check.verdict is status
    if status is Verdict.FAIL:
        assert check.message.startswith(f"{tmp_path / 'kimi.toml'}: shutdown.grace_s: ")
        assert "--shutdown-timeout 30s" in check.message and "set grace_s >= 45" in check.message


def test_check_config_exits_78_when_grace_is_shorter_than_the_drain(tmp_path: Path) -> None:
    path = drain_cfg(tmp_path, "--shutdown-timeout=60", 30)
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 78, result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"kimi-supervisor: config error: {path}: shutdown.grace_s: 30s is shorter than")
    # `run` refuses it the same way, before anything is started (78: systemd does not restart it).
    assert run_cli("--config", str(path)).returncode == 78


def test_dry_run_shows_a_failed_check(tmp_path: Path) -> None:
    path = drain_cfg(tmp_path, "--shutdown-timeout 60", 30)
    result = run_cli("--dry-run", "--config", str(path))
    assert result.returncode == 10, result.stderr
    line = next(x for x in result.stdout.splitlines() if "shutdown_timeouts" in x)
    assert line.lstrip().startswith("[") and "FAILED] shutdown_timeouts" in line and "set grace_s >= 75" in line
    assert "verdict: a start would NOT proceed (1 blocking: shutdown_timeouts)" in result.stdout
    data = json.loads(run_cli("--dry-run", "--json", "--config", str(path)).stdout)
    check = next(c for c in data["checks"] if c["name"] == "shutdown_timeouts")
    assert (check["status"], check["shutdown_timeout_s"], check["required_grace_s"]) == ("failed", 60, 75.0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1min 30s", 90.0), ("90", 90.0), ("6min", 360.0), ("1h 2min 3s", 3723.0), ("500ms", 0.5), ("1.5s", 1.5)],
)
def test_parse_timespan(text: str, seconds: float) -> None:
    assert show.parse_timespan(text) == seconds


@pytest.mark.parametrize("text", ["infinity", "", "soon", "5 parsecs", "1min x"])
def test_parse_timespan_unknown(text: str) -> None:
    assert show.parse_timespan(text) is None


def fake_systemctl(tmp_path: Path, load_state: str, timeout: str) -> dict[str, str]:
    """A real `systemctl` executable first on PATH, answering `show` like systemd 252 does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "systemctl"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/systemctl.args\n'
        f"printf 'LoadState={load_state}\\nTimeoutStopUSec={timeout}\\n'\n"
    )
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_installed_timeout_read_from_systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", fake_systemctl(tmp_path, "loaded", "1min 30s")["PATH"])
    assert show.installed_stop_timeout_s("kimi-supervisor.service") == 90.0
    args = (tmp_path / "systemctl.args").read_text().split()
    assert args == ["show", "kimi-supervisor.service", "-p", "LoadState", "-p", "TimeoutStopUSec"]
    monkeypatch.setenv("PATH", fake_systemctl(tmp_path, "not-found", "1min 30s")["PATH"])
    assert show.installed_stop_timeout_s("kimi-supervisor.service") is None  # systemd's default, not ours


def test_unit_stop_shorter_than_grace_warns(tmp_path: Path) -> None:
    cfg = load_config(drain_cfg(tmp_path, "--shutdown-timeout 300", 315, gpu_release_timeout_s=30))
    short = timeouts.check_unit_stop(cfg, 90.0, "kimi-supervisor.service")
    assert short is not None and short.verdict is Verdict.WARN and not short.blocking
    assert "TimeoutStopSec=90s, shorter than shutdown.grace_s 315s" in short.message
    assert "= 350s" in short.message and "TimeoutStopSec=360" in short.message
    ok = timeouts.check_unit_stop(cfg, 360.0, "kimi-supervisor.service")
    assert ok is not None and ok.verdict is Verdict.OK
    assert timeouts.check_unit_stop(cfg, None, "kimi-supervisor.service") is None  # no systemd: nothing said


def test_check_config_and_dry_run_warn_about_the_installed_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = drain_cfg(tmp_path, "--shutdown-timeout 300", 315)
    monkeypatch.setenv("PATH", fake_systemctl(tmp_path, "loaded", "1min 30s")["PATH"])
    monkeypatch.setattr(show, "systemd_running", lambda: True)
    assert cli.main(["check-config", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    # The config is kimi.toml: deployment kimi, whose unit is the template's instance kimi-supervisor@kimi.
    assert "warning: kimi-supervisor@kimi.service has TimeoutStopSec=90s, shorter than shutdown.grace_s 315s" in err
    assert "run `kimi-supervisor install-unit --instance kimi` (writes TimeoutStopSec=" in err
    assert cli.main(["--dry-run", "--config", str(path)]) == 0  # a warning does not block a start
    out = capsys.readouterr().out
    assert "warn] unit_timeout_stop" in out and "verdict: a start would proceed" in out


def test_install_unit_writes_timeout_stop_from_the_config(tmp_path: Path) -> None:
    path = drain_cfg(tmp_path, "--shutdown-timeout 100", 120, gpu_release_timeout_s=20)
    result = run_cli("install-unit", "--config", str(path), "--unit-dir", str(tmp_path), "--no-reload")
    assert result.returncode == 0, result.stderr
    d = directives((tmp_path / unit.UNIT_NAME).read_text())
    assert d["TimeoutStopSec"] == str(120 + 5 + 20 + 10)


def test_shipped_config_unit_and_drain_line_up() -> None:
    cfg = load_config(SHIPPED)
    assert cfg.child.vllm.shutdown_timeout == 300
    assert timeouts.check_grace(cfg).verdict is Verdict.OK
    assert cfg.shutdown.grace_s == timeouts.required_grace_s(cfg)
    assert (
        timeouts.unit_timeout_stop_s(cfg)
        == unit.DEFAULT_STOP_S
        == int(directives(PACKAGED.read_text())["TimeoutStopSec"])
    )
    check = timeouts.check_unit_stop(cfg, float(unit.DEFAULT_STOP_S), unit.UNIT_NAME)
    assert check is not None and check.verdict is Verdict.OK


@pytest.mark.skipif(not show.systemd_running(), reason="systemd is not PID 1 here")
def test_systemctl_show_on_this_host() -> None:
    result = subprocess.run(["systemctl", "show", "-p", "DefaultTimeoutStopUSec"], capture_output=True, text=True)
    assert show.parse_timespan(result.stdout.partition("=")[2]) is not None
