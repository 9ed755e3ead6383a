"""The metrics textfile, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import kimi_supervisor
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import load_config
from kimi_supervisor.opsview.textfile import MetricsSnapshot, MetricsWriter, render
from kimi_supervisor.opsview.view import OperatorView
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import weights_pair
from tests.promtool import check_metrics

SNAP = MetricsSnapshot(
    state="ready",
    ready_timestamp_s=1_795_990_000.5,
    last_load_s=547.25,
    restarts=3,
    preflight_kills=9,
    shm_removed=2,
    health_latency_s=0.0042,
    canary_latency_s=None,
    gpu_used_mib_at_start={0: 0, 1: 615},
    last_failure=(13, 'vLLM exited with status 0 after it was ready (not requested): "x"'),
    started_timestamp_s=1_795_989_400.0,
    last_failure_timestamp_s=1_795_989_300.25,
)
DEP = {"deployment": "kimi-a", "role": "engine"}


def families() -> dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
    return {
        f.name: (f.type, f.documentation, [(s.name, dict(s.labels), s.value) for s in f.samples])
        for f in text_string_to_metric_families(render(SNAP, "kimi-a").decode())
    }


def test_every_metric_parses_back_with_help_type_and_value() -> None:
    fam = families()
    assert set(fam) == {
        "kimi_supervisor_state",
        "kimi_supervisor_ready_timestamp_seconds",
        "kimi_supervisor_last_load_seconds",
        "kimi_supervisor_restarts",
        "kimi_supervisor_preflight_kills",
        "kimi_supervisor_shm_removals",
        "kimi_supervisor_health_latency_seconds",
        "kimi_supervisor_gpu_memory_used_at_start_bytes",
        "kimi_supervisor_last_failure_info",
        "kimi_supervisor_start_timestamp_seconds",
        "kimi_supervisor_last_failure_timestamp_seconds",
        "kimi_supervisor_build_info",
    }
    assert all(doc for _, doc, _ in fam.values())  # HELP on each
    assert fam["kimi_supervisor_state"][2] == [
        ("kimi_supervisor_state", {**DEP, "state": s}, 1.0 if s == "ready" else 0.0)
        for s in ("preflight", "starting", "ready", "stopping", "stopped", "failed")
    ]
    assert fam["kimi_supervisor_ready_timestamp_seconds"][2] == [
        ("kimi_supervisor_ready_timestamp_seconds", DEP, 1_795_990_000.5)
    ]
    assert fam["kimi_supervisor_last_load_seconds"][2][0][2] == 547.25
    for name, value in (("restarts", 3.0), ("preflight_kills", 9.0), ("shm_removals", 2.0)):
        kind, _, samples = fam[f"kimi_supervisor_{name}"]
        assert kind == "counter" and samples == [(f"kimi_supervisor_{name}_total", DEP, value)]
    assert fam["kimi_supervisor_health_latency_seconds"][2][0][2] == 0.0042
    assert fam["kimi_supervisor_gpu_memory_used_at_start_bytes"][2] == [
        ("kimi_supervisor_gpu_memory_used_at_start_bytes", {**DEP, "gpu": "0"}, 0.0),
        ("kimi_supervisor_gpu_memory_used_at_start_bytes", {**DEP, "gpu": "1"}, 615.0 * 1024 * 1024),
    ]
    # The text format has no info type: an info metric is a gauge of 1 whose labels carry the data.
    kind, _, [(name, labels, value)] = fam["kimi_supervisor_last_failure_info"]
    assert kind == "gauge" and name == "kimi_supervisor_last_failure_info" and value == 1.0
    assert labels == {**DEP, "exit_code": "13", "reason": "child_died"}
    [(_, labels, value)] = fam["kimi_supervisor_last_failure_timestamp_seconds"][2]
    assert labels == {**DEP, "exit_code": "13", "reason": "child_died"} and value == 1_795_989_300.25
    assert fam["kimi_supervisor_start_timestamp_seconds"][2] == [
        ("kimi_supervisor_start_timestamp_seconds", DEP, 1_795_989_400.0)
    ]
    # Which build writes it: the version `--version` prints (setuptools-scm's, from git).
    assert fam["kimi_supervisor_build_info"][2] == [
        ("kimi_supervisor_build_info", {**DEP, "version": kimi_supervisor.__version__}, 1.0)
    ]


def test_every_series_names_its_deployment() -> None:
    """Two deployments' textfiles side by side in node_exporter's directory: no series of one is the other's."""
    series = {}
    for name in ("kimi-a", "kimi-b"):
        for family in text_string_to_metric_families(render(SNAP, name).decode()):
            for sample in family.samples:
                assert sample.labels["deployment"] == name, sample
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in series
                series[key] = sample.value
    assert len(series) == 2 * 18


def node_exporter_problems(*texts: bytes) -> list[str]:
    """What node_exporter's textfile collector refuses when it gathers several files into one scrape
    (client_golang's Gather): a series twice (same name and label values), or one family with two types or
    two HELP texts across files.  Any of them fails the whole scrape, every deployment's series with it."""
    problems: list[str] = []
    kinds: dict[str, tuple[str, str]] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if kinds.setdefault(family.name, (family.type, family.documentation)) != (
                family.type,
                family.documentation,
            ):
                problems.append(f"{family.name}: type or HELP differs between files")
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in seen:
                    problems.append(f"{sample.name}{dict(key[1])} was collected before with the same label values")
                seen.add(key)
    return problems


def test_a_weight_holder_and_its_engine_can_be_scraped_together(tmp_path: Path) -> None:
    """One deployment, two supervisors (its weight holder and its engine), two textfiles in node_exporter's
    directory: every series stays distinct (`role`), so node_exporter serves both (was: every series twice)."""
    holder_path, engine_path = weights_pair(tmp_path)
    texts = []
    for path, role in ((holder_path, "weights"), (engine_path, "engine")):
        cfg = load_config(path)
        prom = tmp_path / f"{role}.prom"
        cfg = dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, textfile=prom))
        view = OperatorView(cfg, FakeGpuProbe([]), RecordingLog(), ReadinessTracker(cfg.readiness), None)
        assert view.metrics is not None
        view.metrics.write(SNAP)  # the writer the supervisor's view builds from its config
        texts.append(prom.read_bytes())
    assert node_exporter_problems(*texts) == []
    for text, role in zip(texts, ("weights", "engine"), strict=True):
        for family in text_string_to_metric_families(text.decode()):
            assert all(s.labels["deployment"] == "kimi" and s.labels["role"] == role for s in family.samples)
    # The check can fail: the same file twice is every series twice.
    assert len(node_exporter_problems(texts[1], texts[1])) == 19


def test_textfile_passes_promtool_check_metrics(tmp_path: Path) -> None:
    """What node_exporter's operators lint with: HELP and TYPE, `_total` counters, base units, valid names."""
    full = render(SNAP, "kimi-a")
    bare = render(MetricsSnapshot(state="starting"), "kimi-supervisor")
    assert check_metrics(full) == "" and check_metrics(bare) == ""
    # The check can fail: a counter without `_total` and a HELP-less metric are refused.
    assert check_metrics(b"# TYPE kimi_supervisor_restarts counter\nkimi_supervisor_restarts 1\n") != ""


def test_no_free_text_in_a_label() -> None:
    """A root cause is vLLM's text (a client's model name, say): never a label value, whatever it says."""
    cause = 'vLLM failed: "Error with model \\"EngineDeadError\\"\\n} 1\\nfake_metric 9"'
    for code, reason in ((13, "child_died"), (18, "gpu_failed"), (11, "startup_failed"), (99, "unknown")):
        text = render(dataclasses.replace(SNAP, last_failure=(code, cause)), "kimi-a").decode()
        assert "EngineDeadError" not in text and "fake_metric" not in text
        fam = {f.name: f for f in text_string_to_metric_families(text)}
        [sample] = fam["kimi_supervisor_last_failure_info"].samples
        assert dict(sample.labels) == {**DEP, "exit_code": str(code), "reason": reason}


def test_unknown_values_are_left_out_not_zero() -> None:
    text = render(MetricsSnapshot(state="starting"), "kimi-a").decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "kimi_supervisor_last_load_seconds" not in names
    assert "kimi_supervisor_health_latency_seconds" not in names
    assert "kimi_supervisor_canary_latency_seconds" not in names
    assert "kimi_supervisor_last_failure_info" not in names
    assert "kimi_supervisor_last_failure_timestamp_seconds" not in names
    assert "kimi_supervisor_start_timestamp_seconds" not in names


def test_writer_is_atomic_world_readable_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "kimi_supervisor.prom"
    old = os.umask(0o077)  # the unit's UMask=
    try:
        MetricsWriter(path, RecordingLog(), "kimi-a").write(SNAP)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_bytes() == render(SNAP, "kimi-a", "engine", "kimi_supervisor.prom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kimi_supervisor.prom"]


def test_unwritable_textfile_warns_once(tmp_path: Path) -> None:
    log = RecordingLog()
    writer = MetricsWriter(tmp_path / "missing-dir" / "k.prom", log, "kimi-a")
    writer.write(SNAP)
    writer.write(SNAP)
    assert len(log.events("metrics.unwritable")) == 1
