"""Options mean what they say (docs/configuration.md): each command takes only its own options.

`install-unit --dry-run` used to install the unit and daemon-reload: every option was accepted by every
command and silently ignored where it did not apply.  Now a misplaced option is a usage error, exit 2, one
line naming the command it belongs to; the documented invocations keep working.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.cli import entry as cli
from testkit.harness import REPO


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )


def test_install_unit_dry_run_is_a_usage_error_and_installs_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('[child]\nargv = ["vllm"]\n')
    units = tmp_path / "units"
    result = run("install-unit", "--dry-run", "--no-reload", "--config", str(cfg), "--unit-dir", str(units))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""
    assert "kimi-supervisor install-unit: error: unrecognized arguments: --dry-run" in result.stderr
    assert "--dry-run belongs to run" in result.stderr
    assert not units.exists()  # nothing written, nothing reloaded


@pytest.mark.parametrize(
    ("args", "owner"),
    [
        (["status", "--no-reload"], "--no-reload belongs to install-unit"),
        (["status", "--dry-run"], "--dry-run belongs to run"),
        (["status", "--unit-dir", "/x"], "--unit-dir belongs to install-unit"),
        (["status", "--log-format", "json"], "--log-format belongs to run"),
        (["check-config", "--watch"], "--watch belongs to status"),
        (["check-config", "--dry-run"], "--dry-run belongs to run"),
        (["install-unit", "--json"], "--json belongs to run and check-config and status"),
        (["install-unit", "--watch"], "--watch belongs to status"),
        (["--unit-dir", "/x"], "--unit-dir belongs to install-unit"),
        (["run", "--watch"], "--watch belongs to status"),
        (["--no-reload"], "--no-reload belongs to install-unit"),
    ],
)
def test_a_misplaced_option_is_a_one_line_usage_error(
    args: list[str], owner: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.parse_args(args)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and owner in err and "unrecognized arguments" in err


def test_json_without_dry_run_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        cli.parse_args(["--json"])
    assert raised.value.code == 2
    assert capsys.readouterr().err == (
        "kimi-supervisor: error: --json needs --dry-run (a run writes log records, not a report); "
        "see kimi-supervisor --help\n"
    )


@pytest.mark.parametrize(
    ("args", "command", "fields"),
    [
        (["--dry-run", "--config", "c.toml"], "run", {"dry_run": True}),  # README: no command means run
        (["--dry-run", "--json"], "run", {"dry_run": True, "json": True}),
        (["run", "--dry-run", "--log-format", "json"], "run", {"dry_run": True, "log_format": "json"}),
        (["--config", "status", "status", "--json", "--watch"], "status", {"json": True, "watch": True}),
        (["--config", "c.toml", "status"], "status", {}),  # options before the command, as before
        (["check-config", "--json"], "check-config", {"json": True}),
        (["install-unit", "--unit-dir", "/u", "--no-reload"], "install-unit", {"unit_dir": Path("/u")}),
    ],
)
def test_documented_invocations_still_parse(args: list[str], command: str, fields: dict[str, object]) -> None:
    ns = cli.parse_args(args)
    assert ns.command == command
    for key, value in fields.items():
        assert getattr(ns, key) == value
    if "--config" in args:
        assert ns.config == Path(args[args.index("--config") + 1])


def test_each_commands_help_lists_only_its_own_options() -> None:
    text = run("install-unit", "--help").stdout
    assert "--unit-dir" in text and "--no-reload" in text and "--dry-run" not in text and "--json" not in text
    text = run("status", "--help").stdout
    assert "--watch" in text and "--json" in text and "--dry-run" not in text and "--no-reload" not in text
