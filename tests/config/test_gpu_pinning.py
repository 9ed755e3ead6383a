"""Several deployments on a host, truly apart (docs/configuration.md): the child is pinned to preflight.gpus in PCI bus
order, gets its own NCCL RAS endpoint, and a single node's GPUs must cover TP x PP x DP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_supervisor.checks import Verdict
from kimi_supervisor.config.gpu_pinning import pin_every_gpu
from kimi_supervisor.preflight.checks import check_gpu_count
from tests.config.config_text import error_of, load


def text(argv: list[str], gpus: object = None, env: dict[str, str] | None = None, extra: str = "") -> str:
    out = f"[child]\nargv = {json.dumps(['vllm', 'serve', '/m', *argv])}\n"
    if env:
        out += "[child.env]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in env.items())
    if gpus is not None:
        out += f"[preflight]\ngpus = {json.dumps(gpus)}\n"
    return out + extra


def test_the_child_is_pinned_to_preflight_gpus_in_pci_bus_order(tmp_path: Path) -> None:
    env = load(tmp_path, text(["-tp", "4"], [4, 5, 6, 7], {"HF_HOME": "/h"})).child.env
    assert env == {
        "HF_HOME": "/h",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NCCL_RAS_ADDR": "127.0.0.1:28108",  # 28100 + 2 x its lowest GPU: no other deployment holds GPU 4
    }


def test_a_cpu_deployment_keeps_its_environment(tmp_path: Path) -> None:
    assert load(tmp_path, text([], [], {"A": "1"})).child.env == {"A": "1"}


def test_all_gpus_fixes_the_order_here_and_the_indices_at_start(tmp_path: Path) -> None:
    env = load(tmp_path, text(["-tp", "2"])).child.env
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_RAS_ADDR": "127.0.0.1:28100"}
    assert pin_every_gpu(env, 3)["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert "CUDA_VISIBLE_DEVICES" not in pin_every_gpu(env, 0)  # NVML silent: the preflight fails on it
    assert "CUDA_VISIBLE_DEVICES" not in pin_every_gpu({}, 3)  # a CPU deployment (gpus = [])


def test_the_same_gpus_in_child_env_are_kept(tmp_path: Path) -> None:
    env = load(tmp_path, text([], [2, 3], {"CUDA_VISIBLE_DEVICES": "3,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})).child.env
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("3,2", "PCI_BUS_ID")


@pytest.mark.parametrize(
    ("gpus", "env", "expected"),
    [
        (
            [2, 3],
            {"CUDA_VISIBLE_DEVICES": "0,1"},
            "{p}: child.env.CUDA_VISIBLE_DEVICES: '0,1' pins other GPUs than preflight.gpus = [2, 3]: remove it "
            "(the supervisor pins preflight.gpus) or set preflight.gpus to the same NVML indices",
        ),
        (
            [0],
            {"CUDA_VISIBLE_DEVICES": "GPU-5c6f1a2e-0000-0000-0000-000000000000"},
            "{p}: child.env.CUDA_VISIBLE_DEVICES: 'GPU-5c6f1a2e-0000-0000-0000-000000000000' pins other GPUs than "
            "preflight.gpus = [0]: remove it (the supervisor pins preflight.gpus) or set preflight.gpus to the same "
            "NVML indices",
        ),
        (
            None,
            {"CUDA_VISIBLE_DEVICES": "0,1"},
            "{p}: child.env.CUDA_VISIBLE_DEVICES: '0,1' pins other GPUs than preflight.gpus = \"all\" (every GPU NVML "
            "sees): remove it (the supervisor pins preflight.gpus) or set preflight.gpus to the same NVML indices",
        ),
        (
            [0, 1],
            {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
            "{p}: child.env.CUDA_DEVICE_ORDER: 'FASTEST_FIRST': CUDA would number the GPUs otherwise than the NVML "
            "indices preflight.gpus names; remove it (the supervisor sets PCI_BUS_ID)",
        ),
        (
            [0, 1],
            {"NCCL_RAS_ADDR": "localhost"},
            "{p}: child.env.NCCL_RAS_ADDR: expected HOST:PORT (PORT 1..65535, as NCCL reads it), got 'localhost'",
        ),
    ],
)
def test_child_env_that_pins_other_gpus_is_a_config_error(
    tmp_path: Path, gpus: object, env: dict[str, str], expected: str
) -> None:
    assert error_of(tmp_path, text([], gpus, env)) == expected


def test_nccl_ras_addr_from_child_env_wins_and_a_holder_takes_the_port_beside_its_engine(tmp_path: Path) -> None:
    given = load(tmp_path, text([], [0, 1], {"NCCL_RAS_ADDR": "127.0.0.1:31000"})).child.env
    assert given["NCCL_RAS_ADDR"] == "127.0.0.1:31000"
    holder = text([], [6, 7], extra='[deployment]\nrole = "weights"\n').replace(
        '"serve", "/m"', '"preload", "--model", "/m"'
    )
    assert load(tmp_path, holder).child.env["NCCL_RAS_ADDR"] == "127.0.0.1:28113"


@pytest.mark.parametrize(
    ("argv", "flags", "world"),
    [
        (["-tp", "4", "-pp", "2"], "--tensor-parallel-size 4 x --pipeline-parallel-size 2", 8),
        (
            ["--tensor-parallel-size=4", "--pipeline-parallel-size=2"],
            "--tensor-parallel-size 4 x --pipeline-parallel-size 2",
            8,
        ),
        (["-tp=2", "-dp", "4"], "--tensor-parallel-size 2 x --data-parallel-size 4", 8),
        (
            ["--tensor-parallel-size", "2", "-pp=2", "--data-parallel-size=2"],
            "--tensor-parallel-size 2 x --pipeline-parallel-size 2 x --data-parallel-size 2",
            8,
        ),
        (["-tp", "5"], "--tensor-parallel-size 5", 5),
    ],
)
def test_world_size_is_tp_times_pp_times_dp(tmp_path: Path, argv: list[str], flags: str, world: int) -> None:
    assert error_of(tmp_path, text(argv, [0, 1, 2, 3])) == (
        f"{{p}}: preflight.gpus: 4 GPU(s) [0, 1, 2, 3], but child.argv's {flags} needs {world}"
    )


def test_a_world_that_fits_is_accepted(tmp_path: Path) -> None:
    vllm = load(tmp_path, text(["-tp", "2", "--pipeline-parallel-size", "2"], [0, 1, 2, 3])).child.vllm
    assert (vllm.tensor_parallel_size, vllm.pipeline_parallel_size, vllm.world_size) == (2, 2, 4)


def test_all_gpus_too_few_for_the_world_fails_the_preflight_naming_the_flags() -> None:
    check = check_gpu_count(4, (0, 1, 2, 3), 4, 8, "--tensor-parallel-size 4 x --pipeline-parallel-size 2")
    assert check.verdict is Verdict.FAIL
    assert check.message == (
        "--tensor-parallel-size 4 x --pipeline-parallel-size 2 needs 8 GPUs but only 4 are available "
        "(NVML sees 4, preflight.gpus selects [0, 1, 2, 3])"
    )
