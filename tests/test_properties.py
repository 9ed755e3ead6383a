"""Property tests: no input crashes the config loader or the output parsers; errors stay one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_supervisor.child.lines import LineClassifier
from kimi_supervisor.child.process import LineSplitter
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import load_config, parse_config
from kimi_supervisor.config.vllm_args import parse_vllm_args
from kimi_supervisor.exitcodes import ConfigError

CFG = parse_config({"child": {"argv": ["vllm"]}}, Path("t.toml")).readiness
KEYS = [
    "child",
    "argv",
    "env",
    "preflight",
    "gpus",
    "reap",
    "shm",
    "globs",
    "deadline_s",
    "readiness",
    "health",
    "interval_s",
    "shutdown",
    "grace_s",
    "names",
    "user",
    "health_url",
    "directory",
    "x",
]

# TOML has no null: leaves are the scalar types it does have.
scalars = st.one_of(
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=30),
    st.sampled_from(["all", "vllm", "/dev/shm", "http://127.0.0.1:1/h"]),
)
toml_like = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(KEYS), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(KEYS), toml_like, max_size=6))
def test_parse_config_never_crashes(data: dict[str, Any]) -> None:
    try:
        parse_config(data, Path("/etc/k.toml"))
    except ConfigError as err:
        assert "\n" not in err.message and err.message.startswith("/etc/k.toml: ")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_load_config_on_arbitrary_bytes(tmp_path_factory: Any, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "k.toml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError as err:
        assert "\n" not in err.message and err.message.startswith(str(path))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=12))
def test_vllm_args_raise_only_value_errors(argv: list[str]) -> None:
    try:
        parse_vllm_args(["vllm", *argv])
    except ValueError as exc:
        assert "\n" not in str(exc)


lines = st.one_of(
    st.text(max_size=200),
    st.builds(
        lambda p, pid, lvl, body: f"({p} pid={pid}) {lvl} {body}",
        st.sampled_from(["APIServer", "EngineCore_DP0", "Worker_TP3", "VllmWorker TP1", "X_"]),
        st.integers(0, 10**7),
        st.sampled_from(["INFO", "WARNING", "ERROR", "", "DEBUG"]),
        st.text(max_size=80),
    ),
    st.builds(
        lambda a, b, c: f"Loading safetensors checkpoint shards: {a}% Completed | {b}/{c}",
        st.integers(-5, 10**6),
        st.integers(-5, 10**9),
        st.integers(-5, 10**9),
    ),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(lines, max_size=30))
def test_parsers_never_crash(batch: list[str]) -> None:
    tracker, classifier = ReadinessTracker(CFG), LineClassifier()
    for line in batch:
        tracker.feed(line)
        priority, fields = classifier.classify(line)
        assert 0 <= priority <= 7 and all(isinstance(v, str) for v in fields.values())
    assert "\n" not in tracker.headline(12.5)
    assert isinstance(tracker.root_cause(), str)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=20), st.integers(8, 2048))
def test_line_splitter_bounds_every_line(chunks: list[bytes], max_line: int) -> None:
    splitter = LineSplitter(max_line=max_line)
    out = [line for chunk in chunks for line in splitter.feed(chunk)] + splitter.close()
    marker = len(" [line cut: more than  bytes]") + 20
    assert all(len(line.encode("utf-8", "replace")) <= 4 * max_line + marker for line in out)
    assert all("\n" not in line and "\r" not in line for line in out)
