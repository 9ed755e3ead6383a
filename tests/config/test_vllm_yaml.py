"""`vllm serve --config kimi.yaml`: the supervisor reads the YAML's flags as vLLM 0.32 does, or refuses the
config with one line naming the file and the key (exit 78).  tests/e2e/test_vllm_yaml_parser.py holds the
same cases against vLLM's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kimi_supervisor.config.vllm_yaml import expand
from testkit.harness import REPO, fake_config, free_port, write_config
from tests.config.config_text import error_of, load


def _toml(argv: list[str], cwd: Path | None = None) -> str:
    text = f"[child]\nargv = {json.dumps(argv)}\n"
    return text + (f'working_directory = "{cwd}"\n' if cwd is not None else "")


def test_the_yaml_port_host_model_and_sizes_are_what_the_supervisor_probes(tmp_path: Path) -> None:
    (tmp_path / "kimi.yaml").write_text(
        "model: /models/kimi\nhost: 127.0.0.2\nport: 9000\ntensor_parallel_size: 4\n"
        "gpu-memory-utilization: 0.85\nenforce-eager: true\nserved-model-name: [kimi, k2]\n"
        "compilation-config: {level: 3}\n"
    )
    cfg = load(tmp_path, _toml(["vllm", "serve", "--config", str(tmp_path / "kimi.yaml")]))
    v = cfg.child.vllm
    assert (v.model, v.host, v.port, v.tensor_parallel_size) == ("/models/kimi", "127.0.0.2", 9000, 4)
    assert (v.gpu_memory_utilization, v.served_model_name) == (0.85, "kimi")
    assert v.health_url == "http://127.0.0.2:9000/health"
    assert v.config_file == str(tmp_path / "kimi.yaml")
    # The child still gets its argv as written: the file stays vLLM's to read.
    assert cfg.child.argv == ("vllm", "serve", "--config", str(tmp_path / "kimi.yaml"))


def test_argv_overrides_the_file_and_the_positional_model_wins(tmp_path: Path) -> None:
    (tmp_path / "k.yml").write_text("model: /models/yaml\nport: 9000\ntensor-parallel-size: 4\n")
    v = load(
        tmp_path, _toml(["vllm", "serve", "/models/cli", "--port", "9100", "--config", "k.yml", "-tp", "2"], tmp_path)
    ).child.vllm
    assert (v.model, v.port, v.tensor_parallel_size) == ("/models/cli", 9100, 2)
    # --model on the command line beats the file's model too.
    v = load(tmp_path, _toml(["vllm", "serve", "--config", "k.yml", "--model", "/models/opt"], tmp_path)).child.vllm
    assert (v.model, v.port) == ("/models/opt", 9000)


def test_no_subcommand_puts_the_file_first(tmp_path: Path) -> None:
    (tmp_path / "k.yaml").write_text("model: /models/yaml\nport: 9000\n")
    argv = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--config",
        str(tmp_path / "k.yaml"),
        "--port",
        "9001",
    ]
    seen, path = expand(argv, None)
    assert path == tmp_path / "k.yaml"
    assert seen == (
        "python3",
        "--model",
        "/models/yaml",
        "--port",
        "9000",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--port",
        "9001",
    )


@pytest.mark.parametrize(
    ("yaml_text", "argv_tail", "needle"),
    [
        ("port: [9000, 9001]\n", [], "k.yaml: port: expected one value, got [9000, 9001]"),
        ("port: true\n", [], "k.yaml: port: expected one value, got True"),
        ("port: nine\n", [], "--port expects an integer, got 'nine'"),
        ("api-key: sk-1\n", [], "k.yaml: api-key: the canary reads it from child.argv"),
        ("- port\n- 9000\n", [], "k.yaml: expected a mapping of vLLM options, got list"),
        ("", [], "k.yaml: expected a mapping of vLLM options, got an empty file"),
        ("port: [9000\n", [], "k.yaml: not YAML (line 2)"),
        ("port: 9000\n", [], "no model: neither child.argv"),
    ],
)
def test_what_vllm_cannot_use_is_a_one_line_config_error(
    tmp_path: Path, yaml_text: str, argv_tail: list[str], needle: str
) -> None:
    (tmp_path / "k.yaml").write_text(yaml_text)
    message = error_of(tmp_path, _toml(["vllm", "serve", "--config", str(tmp_path / "k.yaml"), *argv_tail]))
    assert message.startswith("{p}: child.argv: --config ") and needle in message, message


def test_a_file_vllm_would_not_read_is_refused(tmp_path: Path) -> None:
    (tmp_path / "k.toml.in").write_text("port = 9000\n")
    cases = {
        "--config=/x/k.yaml": "--config=FILE: vLLM 0.32 reads its config file only from two words",
        "missing": f"--config {tmp_path}/missing.yaml: cannot read it: No such file or directory",
        "relative": "--config k.yaml: a relative path is opened in vLLM's working directory",
        "suffix": "reads only a .yaml or .yml file",
        "twice": "--config appears 2 times",
    }
    argvs = {
        "--config=/x/k.yaml": ["vllm", "serve", "/m", "--config=/x/k.yaml"],
        "missing": ["vllm", "serve", "/m", "--config", str(tmp_path / "missing.yaml")],
        "relative": ["vllm", "serve", "/m", "--config", "k.yaml"],
        "suffix": ["vllm", "serve", "/m", "--config", str(tmp_path / "k.toml.in")],
        "twice": ["vllm", "serve", "/m", "--config", "/a.yaml", "--config", "/b.yaml"],
    }
    for case, argv in argvs.items():
        message = error_of(tmp_path, _toml(argv))
        assert message.startswith("{p}: child.argv: ") and cases[case] in message, (case, message)


def test_a_group_or_holder_deployment_keeps_its_flags_in_argv(tmp_path: Path) -> None:
    (tmp_path / "k.yaml").write_text("port: 9000\n")
    text = _toml(["vllm", "serve", "/m", "--config", str(tmp_path / "k.yaml")])
    message = error_of(tmp_path, text + '[cluster]\nnnodes = 2\nnode_rank = 0\nmaster_addr = "127.0.0.1"\n')
    assert "a multi-node or weight-holder deployment keeps every vLLM flag in child.argv" in message


def test_the_dry_run_probes_the_yaml_port_and_names_the_file(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "kimi.yaml").write_text(f"port: {port}\nhost: 127.0.0.1\n")
    config = fake_config(tmp_path, ["--config", str(tmp_path / "kimi.yaml")])
    # The argv's own --port would win over the file wherever it stands: drop it, so the YAML's is in force.
    data = tomllib.loads(config.read_text())
    argv = data["child"]["argv"]
    i = argv.index("--port")
    del argv[i : i + 2]
    write_config(config, data)
    result = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--dry-run", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["vllm-config"]["port"] == port, result.stdout
    assert str(tmp_path / "kimi.yaml") in checks["vllm-config"]["message"]
    assert str(port) in checks["port"]["message"], checks["port"]
