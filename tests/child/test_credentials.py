"""child.credentials: a secret read from systemd's $CREDENTIALS_DIRECTORY (LoadCredential=, which install-unit
writes) into the child's environment only: never argv, never a log line, the config file or a report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor import cli
from kimi_supervisor.child.process import prepare_spawn
from kimi_supervisor.child.spawnplan import Unresolvable, credential_environment
from kimi_supervisor.cli.entry import secret_values
from kimi_supervisor.config.load import load_config, parse_config
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.redact import secrets_in_argv
from testkit.fakes.gpu_cli import idle_gpus, write_gpu_file
from testkit.harness import REPO, Run, fake_config
from tests.conftest import wait_for
from tests.lifecycle.test_gpu_pinning_run import environ_of, printed

KEY = "sk-live-credential-0123456789"
CREDENTIALS = {"VLLM_API_KEY": "kimi-api-key"}


def store(tmp_path: Path, text: str = KEY + "\n", name: str = "kimi-api-key") -> Path:
    directory = tmp_path / "credentials"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return directory


def child(**fields: object) -> dict[str, object]:
    return {"child": {"argv": ["vllm", "serve", "/m"], **fields}}


def test_the_config_maps_variables_to_credential_names(tmp_path: Path) -> None:
    cfg = parse_config(child(credentials=CREDENTIALS), tmp_path / "kimi.toml")
    assert cfg.child.credentials == CREDENTIALS and "VLLM_API_KEY" not in cfg.child.env
    for bad, key in (
        ({"credentials": ["kimi-api-key"]}, "child.credentials"),
        ({"credentials": {"VLLM_API_KEY": "../etc/shadow"}}, "child.credentials.VLLM_API_KEY"),
        ({"credentials": {"VLLM_API_KEY": 7}}, "child.credentials.VLLM_API_KEY"),
        ({"credentials": {"A=B": "x"}}, "child.credentials"),
        ({"credentials": CREDENTIALS, "env": {"VLLM_API_KEY": "x"}}, "child.credentials.VLLM_API_KEY"),
    ):
        with pytest.raises(ConfigError, match=rf"{key}: ") as raised:
            parse_config(child(**bad), tmp_path / "kimi.toml")
        assert raised.value.exit_code == 78


def test_values_are_read_from_the_credentials_directory(tmp_path: Path) -> None:
    directory = store(tmp_path)
    env = {"CREDENTIALS_DIRECTORY": str(directory)}
    assert credential_environment(CREDENTIALS, env) == {"VLLM_API_KEY": KEY}  # echo's newline dropped
    assert credential_environment({}, {}) == {}
    cases = {
        "no directory": ({}, "$CREDENTIALS_DIRECTORY is not set"),
        "missing": ({"CREDENTIALS_DIRECTORY": str(tmp_path / "none")}, "cannot open"),
    }
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "kimi-api-key").symlink_to(directory / "kimi-api-key")
    cases["symlink"] = ({"CREDENTIALS_DIRECTORY": str(tmp_path / "link")}, "cannot open")
    for text, why in (("", "empty"), ("a\0b", "NUL"), ("x" * 70000, "64 KiB")):
        cases[why] = ({"CREDENTIALS_DIRECTORY": str(store(tmp_path / why.replace(" ", "_"), text))}, why)
    for case, (parent, why) in cases.items():
        with pytest.raises(Unresolvable) as raised:
            credential_environment(CREDENTIALS, parent)
        assert raised.value.key == "credentials.VLLM_API_KEY" and why in raised.value.message, case
        assert "sk-live" not in raised.value.message


def test_only_the_childs_environment_gets_the_value(tmp_path: Path) -> None:
    spec = parse_config(child(credentials=CREDENTIALS), tmp_path / "kimi.toml").child
    parent = {"PATH": os.environ["PATH"], "CREDENTIALS_DIRECTORY": str(store(tmp_path))}
    prepared = prepare_spawn(
        spec.__class__(**{**spec.__dict__, "argv": (sys.executable,), "inherit_environment": True}), parent
    )
    assert prepared.env["VLLM_API_KEY"] == KEY
    assert "CREDENTIALS_DIRECTORY" not in prepared.env  # the one value, not the directory of them all
    # A dry run reads no secret.
    dry = prepare_spawn(spec.__class__(**{**spec.__dict__, "argv": (sys.executable,)}), parent, create=False)
    assert "VLLM_API_KEY" not in dry.env


def test_a_secret_in_argv_is_named_for_a_warning() -> None:
    assert secrets_in_argv(["vllm", "serve", "/m", "--api-key", KEY, "--hf-token=hf_x1234", "HF_TOKEN=abcd"]) == [
        "--api-key",
        "--hf-token",
        "HF_TOKEN",
    ]
    assert secrets_in_argv(["vllm", "serve", "/m", "--port", "8000"]) == []


def test_check_config_names_the_credential_never_its_value_and_warns_of_argv_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(store(tmp_path)))
    config = fake_config(tmp_path, ["--api-key", "sk-in-argv-0123"], child={"credentials": {"MY_VAR": "kimi-api-key"}})
    cfg = load_config(config)
    assert KEY in secret_values(cfg)  # redacted from every log line, whatever its variable's name
    assert cli.main(["check-config", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert 'child.credentials.MY_VAR = "kimi-api-key"' in out and KEY not in out and "sk-in-argv" not in out
    assert "warning: child.argv holds a secret (--api-key)" in err and "child.credentials" in err


def test_install_unit_loads_each_credential(tmp_path: Path) -> None:
    config = fake_config(tmp_path, child={"credentials": {"VLLM_API_KEY": "kimi-api-key", "OTHER": "kimi-api-key"}})
    units = tmp_path / "units"
    assert cli.main(["install-unit", "--config", str(config), "--unit-dir", str(units), "--no-reload"]) == 0
    text = (units / "kimi-supervisor.service").read_text()
    assert text.count("LoadCredential=kimi-api-key\n") == 1
    assert (
        cli.main(
            ["install-unit", "--config", str(config), "--instance", "kimi", "--unit-dir", str(units), "--no-reload"]
        )
        == 0
    )
    dropin = units / "kimi-supervisor@kimi.service.d" / "50-kimi-supervisor.conf"
    assert "LoadCredential=kimi-api-key\n" in dropin.read_text()


def test_dry_run_json_names_the_credential_not_its_value(tmp_path: Path) -> None:
    argv_key = ["--api-key", "sk-in-argv-0123"]
    config = fake_config(tmp_path, argv_key, tp=2, preflight={"gpus": "all"}, child={"credentials": CREDENTIALS})
    command = ["-m", "testkit.fakes.gpu_cli", str(gpu_file(tmp_path)), "--config", str(config), "--dry-run", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CREDENTIALS_DIRECTORY": str(store(tmp_path))}
    r = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["child_env"]["VLLM_API_KEY"] == "<credential kimi-api-key>"
    [warning] = [c for c in report["checks"] if c["name"] == "secrets"]
    assert warning["status"] == "warn" and "(--api-key)" in warning["message"]  # a warning: the start proceeds
    assert KEY not in r.stdout + r.stderr and "sk-in-argv-0123" not in r.stdout + r.stderr


def gpu_file(tmp_path: Path) -> Path:
    return write_gpu_file(tmp_path / "gpus.json", idle_gpus(2))


def test_a_run_passes_the_credential_to_the_child_only(tmp_path: Path) -> None:
    """The real supervisor and the fake vLLM: the child's environment has the value; its argv, the
    supervisor's environment and every record (the child's own line printing it included) do not."""
    # And a key left in argv as well: the run warns once, naming the option, not the value.
    fake_args = ["--print-env", "VLLM_API_KEY", "--api-key", "sk-in-argv-0123"]
    config = fake_config(tmp_path, fake_args, child={"credentials": CREDENTIALS})
    entry = ["-m", "testkit.fakes.gpu_cli", str(gpu_file(tmp_path))]
    run = Run(config, tmp_path, env={"CREDENTIALS_DIRECTORY": str(store(tmp_path))}, entry=entry)
    try:
        run.wait_event("state.ready", timeout=60)
        wait_for(lambda: "VLLM_API_KEY" in printed(run), timeout=30)
        assert printed(run)["VLLM_API_KEY"] == "<redacted>"  # the child printed it; the record hides it
        assert environ_of(run.child_pid)["VLLM_API_KEY"] == KEY
        assert "CREDENTIALS_DIRECTORY" not in environ_of(run.child_pid)
        assert KEY.encode() not in Path(f"/proc/{run.child_pid}/cmdline").read_bytes()
        [warning] = [e for e in run.events if e.get("event") == "config.secret_in_argv"]
        assert "(--api-key)" in warning["why"] and "child.credentials" in warning["why"]
    finally:
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.why()
    everything = json.dumps(run.events) + json.dumps(run.child_lines) + "".join(run.raw_stderr)
    assert KEY not in everything and "sk-in-argv-0123" not in everything
