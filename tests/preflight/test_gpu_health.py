"""Preflight GPU health: NVML's counters to ok / warn / FAILED / n/a, per-check policy, and the real preflight."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kimi_supervisor.checks import Verdict
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.config.model import GpuHealthConfig
from kimi_supervisor.exitcodes import ExitCode, PreflightError
from kimi_supervisor.host import nvml_counters as nvml_health
from kimi_supervisor.host.gpu import GpuHealth
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.gpu_health import evaluate
from kimi_supervisor.preflight.report import render_text
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import HEALTHY, FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from tests.conftest import ProcSpawner

DEFAULT = GpuHealthConfig(True, (63, 92), "fail", "fail", "fail", "warn", "warn", "warn")


def h(index: int = 0, **fields: Any) -> GpuHealth:
    return dataclasses.replace(HEALTHY, index=index, **fields)


def by_name(health: list[GpuHealth], cfg: GpuHealthConfig = DEFAULT) -> dict[str, tuple[str, str]]:
    return {c.name: (c.verdict.value, c.message) for c in evaluate(health, cfg)}


def test_healthy_h200s_are_ok_with_numbers_and_page_retirement_is_na() -> None:
    got = by_name([h(0), h(1)])
    assert got == {
        "gpu_retired_pages": ("n/a", "GPU 0, 1: page retirement not supported"),
        "gpu_remapped_rows": ("ok", "GPU 0, 1: 0 correctable, 0 uncorrectable remapped row(s), none pending"),
        "gpu_ecc": ("ok", "GPU 0, 1: 0 volatile uncorrectable ECC error(s) since the driver loaded"),
        "gpu_pcie": ("ok", "GPU 0, 1: PCIe x16 gen 5 (max x16 gen 5)"),
        "gpu_persistence": ("ok", "GPU 0, 1: persistence mode on"),
        "gpu_clocks": ("ok", "GPU 0, 1: no HW slowdown or thermal clock events (reasons 0x0)"),
    }


@pytest.mark.parametrize(
    ("fields", "check", "status", "message"),
    [
        (
            {"retired_pages": 3, "retired_pages_pending": True},
            "gpu_retired_pages",
            "failed",
            "GPU 1: 3 retired page(s), a retirement is pending (needs a GPU reset)",
        ),
        (
            {"remapped_rows_uncorrectable": 2, "remapped_rows_pending": True},
            "gpu_remapped_rows",
            "failed",
            "GPU 1: a row remap is pending (0 correctable, 2 uncorrectable remapped row(s)): needs a GPU reset",
        ),
        (
            {"remapped_rows_failed": True},
            "gpu_remapped_rows",
            "failed",
            "GPU 1: row remapping FAILED, no spare rows left (0 correctable, 0 uncorrectable remapped row(s)): "
            "the GPU needs replacing",
        ),
        (
            {"ecc_uncorrected_volatile": 4},
            "gpu_ecc",
            "failed",
            "GPU 1: 4 volatile uncorrectable ECC error(s) since the driver loaded",
        ),
        ({"pcie_width": 8}, "gpu_pcie", "warn", "GPU 1: PCIe x8 gen 5 (max x16 gen 5): link width degraded"),
        (
            {"pcie_gen": 3},
            "gpu_pcie",
            "warn",
            "GPU 1: PCIe x16 gen 3 (max x16 gen 5): link generation below max while not idle",
        ),
        (
            {"persistence_mode": False},
            "gpu_persistence",
            "warn",
            "GPU 1: persistence mode off: the driver sets the GPU up again for each client (nvidia-persistenced)",
        ),
        (
            {"clock_event_reasons": 0x40 | 0x8 | 0x4},
            "gpu_clocks",
            "warn",
            "GPU 1: clocks held down by HW slowdown, HW thermal slowdown (reasons 0x4c)",
        ),
    ],
)
def test_a_sick_gpu_is_named_with_its_numbers(fields: dict[str, Any], check: str, status: str, message: str) -> None:
    got = by_name([h(0), h(1, **fields)])
    assert got[check] == (status, message)
    assert all(s in ("ok", "n/a") for name, (s, _) in got.items() if name != check)


def test_an_idle_gpu_may_train_its_link_down() -> None:
    assert by_name([h(0, pcie_gen=1, clock_event_reasons=0x1)])["gpu_pcie"] == (
        "ok",
        "GPU 0: PCIe x16 gen 1 (max x16 gen 5): lower generation while idle",
    )


def test_policy_per_check() -> None:
    sick = [h(0, remapped_rows_pending=True, persistence_mode=False)]
    relaxed = dataclasses.replace(DEFAULT, remapped_rows="warn", persistence_mode="fail", pcie_link="off")
    got = by_name(sick, relaxed)
    assert got["gpu_remapped_rows"][0] == "warn"
    assert got["gpu_persistence"][0] == "failed"
    assert "gpu_pcie" not in got


def test_not_supported_is_na_and_other_errors_warn_never_fail() -> None:
    consumer = GpuHealth(index=0, errors={"persistence_mode": "Insufficient Permissions"})
    got = by_name([consumer])
    assert got["gpu_ecc"] == ("n/a", "GPU 0: ECC not supported or off")
    assert got["gpu_remapped_rows"] == ("n/a", "GPU 0: row remapping not supported")
    assert got["gpu_persistence"] == ("warn", "GPU 0: could not read persistence_mode: Insufficient Permissions")
    assert not any(s == "failed" for s, _ in got.values())


# -- NvmlProbe.health over pynvml -------------------------------------------------------


def fake_nvml(monkeypatch: pytest.MonkeyPatch, fail: dict[str, int]) -> None:
    """pynvml with an H200's answers; `fail` maps a function name to the NVML error it raises."""
    answers: dict[str, Any] = {
        "nvmlDeviceGetRemappedRows": (1, 0, 0, 0),
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetRetiredPages": [],
        "nvmlDeviceGetPersistenceMode": pynvml.NVML_FEATURE_ENABLED,
        "nvmlDeviceGetTotalEccErrors": 0,
        "nvmlDeviceGetCurrPcieLinkWidth": 16,
        "nvmlDeviceGetMaxPcieLinkWidth": 16,
        "nvmlDeviceGetCurrPcieLinkGeneration": 5,
        "nvmlDeviceGetMaxPcieLinkGeneration": 5,
        "nvmlDeviceGetCurrentClocksEventReasons": 0x1,
    }
    for name, value in answers.items():

        def answer(*args: object, _name: str = name, _value: object = value) -> object:
            if _name in fail:
                raise pynvml.NVMLError(fail[_name])
            return _value

        monkeypatch.setattr(pynvml, name, answer)


def test_nvml_health_reads_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, {})
    got = nvml_health.read_health("h0", 0)
    assert got == GpuHealth(0, 0, False, 1, 0, False, False, 0, 16, 16, 5, 5, True, 1, {})


def test_nvml_not_supported_is_none_other_errors_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(
        monkeypatch,
        {
            "nvmlDeviceGetRetiredPages": pynvml.NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetRetiredPagesPendingStatus": pynvml.NVML_ERROR_NOT_SUPPORTED,
            "nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NO_PERMISSION,
        },
    )
    got = nvml_health.read_health("h0", 0)
    assert got.retired_pages is None and got.retired_pages_pending is None
    assert got.ecc_uncorrected_volatile is None
    assert got.errors == {"ecc_uncorrected_volatile": "Insufficient Permissions"}
    assert by_name([got])["gpu_retired_pages"][0] == "n/a"
    assert by_name([got])["gpu_ecc"][0] == "warn"


# -- in the preflight ---------------------------------------------------------------------


def _cfg(tmp_path: Path, **gpu_health: object) -> Any:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    argv = ["vllm", "serve", "/m", "--tensor-parallel-size", "2", "--port", "1"]
    return parse_config(
        {
            "child": {"argv": argv},
            "preflight": {"check_model": False, "check_port": False, "shm": {"directory": str(shm)}},
            "gpu_health": gpu_health,
        },
        tmp_path / "k.toml",
    )


def test_a_pending_row_remap_fails_the_start_before_anything_is_killed(tmp_path: Path, spawner: ProcSpawner) -> None:
    victim = spawner.sleeper(title="VLLM::Worker_TP0")
    sick = dataclasses.replace(HEALTHY, remapped_rows_uncorrectable=1, remapped_rows_pending=True)
    probe = FakeGpuProbe([FakeGpu(occupants={victim.pid: 5000}), FakeGpu(health=sick)])
    pf = Preflight(_cfg(tmp_path), probe, PsutilProcessTable(), FakeClock(), RecordingLog())
    dry = pf.run(dry_run=True)
    text = render_text(dry, "k.toml")
    assert (
        "[      FAILED] gpu_remapped_rows   GPU 1: a row remap is pending "
        "(0 correctable, 1 uncorrectable remapped row(s)): needs a GPU reset" in text
    )
    assert "verdict: a start would NOT proceed (1 blocking: gpu_remapped_rows)" in text
    with pytest.raises(PreflightError) as info:
        pf.run(dry_run=False)
    assert info.value.exit_code == ExitCode.PREFLIGHT_FAILED
    assert info.value.message.startswith("preflight failed: gpu_remapped_rows: GPU 1: a row remap is pending")
    assert victim.poll() is None  # nothing was killed for a start that cannot happen


def test_warnings_do_not_block_and_are_logged(tmp_path: Path) -> None:
    probe = FakeGpuProbe([FakeGpu(health=dataclasses.replace(HEALTHY, persistence_mode=False)), FakeGpu()])
    log = RecordingLog()
    report = Preflight(_cfg(tmp_path), probe, PsutilProcessTable(), FakeClock(), log).run(dry_run=False)
    assert report.proceed
    assert [c.verdict for c in report.checks if c.name == "gpu_persistence"] == [Verdict.WARN]
    assert log.events("preflight.gpu_health") == [
        {
            "check": "gpu_persistence",
            "message": "GPU 0: persistence mode off: the driver sets the GPU up again for each client "
            "(nvidia-persistenced)",
        }
    ]


def test_policy_off_everywhere_shows_no_health_lines(tmp_path: Path) -> None:
    off = dict.fromkeys(
        ("retired_pages", "remapped_rows", "ecc_uncorrected", "pcie_link", "persistence_mode", "clock_events"), "off"
    )
    sick = dataclasses.replace(HEALTHY, remapped_rows_failed=True)
    probe = FakeGpuProbe([FakeGpu(health=sick), FakeGpu()])
    report = Preflight(_cfg(tmp_path, **off), probe, PsutilProcessTable(), FakeClock(), RecordingLog()).run(
        dry_run=True
    )
    assert report.proceed
    assert [c.name for c in report.checks] == [
        "gpus",
        "shutdown_timeouts",
        "cache",
        "gpu_wait",
        "shm",
        "gpu_memory_fraction",
    ]
