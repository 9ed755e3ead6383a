"""A start broken down, end to end in the lifecycle's fake world: vLLM's phase lines and the supervisor's own
measures reach the run history, `status`, the metrics and STATUS=; the read-ahead is started and stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.status import gather, render_text
from kimi_supervisor.config import layout
from kimi_supervisor.host.procio import TreeReadMeter
from kimi_supervisor.opsview.history import RunRecord, parse_history
from kimi_supervisor.opsview.loadreport import describe
from testkit.fakes.lifecycle_world import serving_world

GPU_LINES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_0.32_gpu_format" / "load_phases.log"
SHARDS = "Loading safetensors checkpoint shards:  {pct}% Completed | {done}/2 [00:01<00:08]"


def model(tmp_path: Path, shards: int = 2, size: int = 1 << 20) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for n in names:
        (d / n).write_bytes(os.urandom(size))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: n for n in names}}))
    for n in names:
        (d / n).read_bytes()  # in the page cache: the test knows the residency before the spawn
    return d


def world(tmp_path: Path, model_dir: Path, **sections: Any) -> Any:
    argv = ["vllm", "serve", str(model_dir), "--port", "8000"]
    return serving_world(
        tmp_path, started_at=20.0, child={"argv": argv}, metrics={"textfile": str(tmp_path / "k.prom")}, **sections
    )


def test_the_phases_reach_history_status_and_metrics(tmp_path: Path) -> None:
    d = model(tmp_path)
    w = world(tmp_path, d)
    for i, line in enumerate(GPU_LINES.read_text().splitlines()):
        w.say_at(2.0 + i, line)
    w.signal_at(30.0)
    assert w.run() == 0
    [run] = json.loads((tmp_path / "state" / "kimi" / "history.json").read_text())["runs"]
    assert run["fs_type"] == "NFS4" and run["weights_s"] == 514.22 and run["compile_cache"] == "hit"
    assert run["compile_s"] == 38.4 and run["graphs_s"] == 61 and run["init_engine_s"] == 131.52
    assert run["post_processing_s"] == 8.884
    assert run["checkpoint_bytes"] == 2 << 20 and run["cached_fraction"] == 1.0
    text = render_text(gather(layout.of(w.cfg)), now=w.clock.time())
    assert "Last load: weights 514 s at 4 kB/s from nfs4 (100% cached" in text
    assert "post-processing 8.9 s, compile 38 s (cache hit), graphs 61 s, engine init 132 s" in text
    prom = (tmp_path / "k.prom").read_text()
    assert 'kimi_supervisor_load_phase_seconds{deployment="kimi",phase="weights",role="engine"} 514.22' in prom
    assert 'kimi_supervisor_load_phase_seconds{deployment="kimi",phase="graphs",role="engine"} 61.0' in prom
    assert 'kimi_supervisor_compile_cache_hit{deployment="kimi",role="engine"} 1.0' in prom
    assert 'kimi_supervisor_load_cached_ratio{deployment="kimi",role="engine"} 1.0' in prom


def test_status_shows_the_trees_read_rate_while_weights_load(tmp_path: Path) -> None:
    d = model(tmp_path)
    w = world(tmp_path, d)
    # The tree's read_bytes grow 1.02 GB a fake second (the real counter needs a real tree).
    w.supervisor.view.load.meter = TreeReadMeter(read=lambda pid: int(w.clock.monotonic() * 1.02e9))
    w.say_at(1.0, SHARDS.format(pct=0, done=0))
    w.say_at(12.0, SHARDS.format(pct=50, done=1))
    w.signal_at(25.0)
    assert w.run() == 0
    statuses = [str(f["STATUS"]) for t, f in w.notes.sent if "STATUS" in f and 8.0 < t < 12.0]
    assert statuses and all(s.startswith("starting: loading weights 0/2 (0%)") for s in statuses)
    assert all(", 1.02 GB/s" in s for s in statuses)
    [run] = json.loads((tmp_path / "state" / "kimi" / "history.json").read_text())["runs"]
    assert run["read_bytes"] >= 19e9  # read at ~1.02 GB/s until ready at 20 s


def test_a_start_that_failed_keeps_the_phases_it_reached(tmp_path: Path) -> None:
    d = model(tmp_path)
    w = world(tmp_path, d)
    w.say_at(2.0, "(Worker pid=3) INFO 12-01 22:24:22 [default_loader.py:501] Loading weights took 514.22 seconds")
    w.say_at(3.0, "(Worker pid=3) ERROR 12-01 22:24:23 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
              "unexpectedly (exit code: -9), shutting down executor.")  # fmt: skip
    assert w.run() != 0
    [run] = json.loads((tmp_path / "state" / "kimi" / "history.json").read_text())["runs"]
    assert run["weights_s"] == 514.22 and run["ready"] is None


def test_the_readahead_starts_before_the_preflight_and_stops_when_weights_are_loaded(tmp_path: Path) -> None:
    d = model(tmp_path, shards=3)
    w = world(tmp_path, d, readahead={"enabled": True, "shards_ahead": 1})
    w.say_at(2.0, SHARDS.format(pct=0, done=0))
    w.say_at(5.0, "(Worker pid=3) INFO 12-01 22:24:22 [default_loader.py:501] Loading weights took 3.00 seconds")
    w.signal_at(30.0)
    assert w.run() == 0
    names = w.names()
    assert names.index("readahead.started") < names.index("preflight.passed")
    [stopped] = w.events("readahead.stopped")
    assert stopped["reason"] in ("vLLM's weights are loaded", "every shard read") and stopped["thread_ended"]
    assert stopped["bytes_read"] <= 3 << 20


def test_history_rejects_what_no_supervisor_writes() -> None:
    good = {"start": 1.0, "pid": 5, "compile_cache": "hit", "fs_type": "NFS4", "weights_s": 1.5, "read_bytes": 7}
    doc = {"schema": 1, "runs": [good]}
    [r] = parse_history(json.dumps(doc).encode()).runs
    assert (r.compile_cache, r.fs_type, r.weights_s, r.read_bytes) == ("hit", "NFS4", 1.5, 7)
    for bad in ({"compile_cache": "maybe"}, {"fs_type": "\x1b[2J"}, {"read_bytes": -1}, {"weights_s": "1"}):
        try:
            parse_history(json.dumps({"schema": 1, "runs": [good | bad]}).encode())
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_describe_says_unknown_by_leaving_it_out() -> None:
    assert describe(RunRecord(start=1.0, pid=1)) is None
    r = RunRecord(start=1.0, pid=1, weights_s=0.01, init_engine_s=4.29, fs_type="EXT4", compile_cache="miss")
    assert describe(r) == "weights 0.01 s from ext4, compile (cache miss), engine init 4.3 s"
