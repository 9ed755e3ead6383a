"""CLI: dry-run report and exit codes, check-config, config permissions, version, help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kimi_supervisor
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ConfigError
from testkit.harness import REPO, fake_config


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_version_and_help() -> None:
    assert cli("--version").stdout.strip() == f"kimi-supervisor {kimi_supervisor.__version__}"
    help_text = cli("--help").stdout
    for needle in ("--dry-run", "check-config", "exit codes:", " 78  configuration error", " 10  preflight failed"):
        assert needle in help_text


def test_dry_run_without_gpu_says_why_and_exits_10() -> None:
    result = cli("--dry-run", "--config", str(REPO / "etc" / "kimi-supervisor.toml"))
    assert result.returncode == 10
    lines = result.stdout.splitlines()
    assert lines[0] == "kimi-supervisor preflight (dry run: nothing was killed or removed)"
    assert any(line.strip().startswith("[      FAILED] nvml") for line in lines)
    assert lines[-1].startswith("verdict: a start would NOT proceed")


def test_dry_run_json(tmp_path: Path) -> None:
    result = cli("--dry-run", "--json", "--config", str(fake_config(tmp_path)))
    data = json.loads(result.stdout)
    assert result.returncode == 0 and data["proceed"] is True
    assert [c["name"] for c in data["checks"]] == ["gpus", "shutdown_timeouts", "cache", "shm", "port"]


def test_check_config_prints_effective_config_with_secrets_redacted(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(
        '[child]\nargv = ["vllm", "serve", "/m", "--api-key", "sk-live-123"]\n'
        'env = { HF_TOKEN = "hf_abc", NCCL_PROTO = "LL" }\n'
    )
    result = cli("check-config", "--config", str(cfg))
    assert result.returncode == 0
    out = result.stdout
    assert 'child.argv = ["vllm", "serve", "/m", "--api-key", "<redacted>"]' in out
    # What the child gets over the inherited environment: child.env, its GPU order and its NCCL RAS endpoint.
    env = '{"HF_TOKEN": "<redacted>", "NCCL_PROTO": "LL", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", '
    env += '"NCCL_RAS_ADDR": "127.0.0.1:28100"}'
    assert f"child.env = {env}" in out
    assert "sk-live-123" not in out and "hf_abc" not in out
    assert 'readiness.health_url = "http://127.0.0.1:8000/health"' in out
    as_json = json.loads(cli("check-config", "--json", "--config", str(cfg)).stdout)
    assert as_json["child"]["argv"][-1] == "<redacted>"
    assert as_json["child"]["env"] == json.loads(env)


def test_shipped_config_check() -> None:
    result = cli("check-config", "--config", str(REPO / "etc" / "kimi-supervisor.toml"))
    assert result.returncode == 0
    assert "child.vllm.tensor_parallel_size = 8" in result.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="the check applies when running as root")
def test_config_writable_by_others_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('[child]\nargv = ["vllm"]\n')
    cfg.chmod(0o666)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.message == (
        f"{cfg}: writable by group or others (mode 0666); refusing it while running as root (chmod go-w {cfg})"
    )
    cfg.chmod(0o644)
    os.chown(cfg, 65534, 0)
    with pytest.raises(ConfigError, match="owned by uid 65534, not root"):
        load_config(cfg)
    result = cli("--dry-run", "--config", str(cfg))
    assert result.returncode == 78 and result.stderr.count("\n") == 1


def test_bad_arguments_exit_2() -> None:
    assert cli("--log-format", "xml").returncode == 2


def test_install_unit_command(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('[child]\nargv = ["vllm"]\n')
    result = cli("install-unit", "--config", str(cfg), "--unit-dir", str(tmp_path / "units"), "--no-reload")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"wrote {tmp_path / 'units' / 'kimi-supervisor.service'}; now: systemctl enable --now kimi-supervisor.service\n"
    )
    assert f"--config {cfg}" in (tmp_path / "units" / "kimi-supervisor.service").read_text()
