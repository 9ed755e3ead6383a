"""journald: native-protocol records with PRIORITY and fields; secrets scrubbed; fallbacks."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import structlog

from kimi_supervisor.logs.journal import (
    JournalWriter,
    configure,
    encode_journal,
    get_logger,
    journal_stream_is_stderr,
    resolve_format,
)
from testkit.fakes.journal_socket import JournalSocket, decode


def test_encode_round_trip_with_newlines() -> None:
    data = encode_journal({"MESSAGE": "two\nlines", "PRIORITY": 3, "X": "é"})
    assert decode(data) == {"MESSAGE": "two\nlines", "PRIORITY": "3", "X": "é"}


def test_supervisor_events_carry_priority_and_fields(journal: JournalSocket) -> None:
    configure("journal", journal_socket=journal.path)
    log = get_logger()
    log.info("preflight.passed", checks=5)
    log.warning("preflight.kill", pid=123, gpu="0", name="VLLM::Worker_TP0", signal="SIGTERM")
    log.debug("dropped.below.level")
    records = journal.records()
    assert len(records) == 2
    info, warn = records
    assert info["PRIORITY"] == "6" and info["KIMI_EVENT"] == "preflight.passed" and info["KIMI_CHECKS"] == "5"
    assert warn["PRIORITY"] == "4" and warn["KIMI_PID"] == "123" and warn["KIMI_GPU"] == "0"
    assert warn["KIMI_SOURCE"] == "supervisor" and warn["SYSLOG_IDENTIFIER"] == "kimi-supervisor"
    assert warn["MESSAGE"] == "preflight.kill pid=123 gpu=0 name=VLLM::Worker_TP0 signal=SIGTERM"


def test_child_lines_go_through_the_sink(journal: JournalSocket) -> None:
    sink = configure("journal", journal_socket=journal.path)
    sink.line("(Worker_TP3 pid=42) ERROR boom", 3, {"VLLM_COMPONENT": "Worker", "VLLM_RANK": "3", "VLLM_PID": "42"})
    (rec,) = journal.records()
    assert rec["PRIORITY"] == "3" and rec["KIMI_SOURCE"] == "child" and rec["VLLM_RANK"] == "3"
    assert rec["MESSAGE"] == "(Worker_TP3 pid=42) ERROR boom"


def test_secrets_are_scrubbed(journal: JournalSocket) -> None:
    configure("journal", secrets=("hf_s3cr3tvalue",), journal_socket=journal.path)
    get_logger().info("supervisor.start", argv="--x hf_s3cr3tvalue", api_key="abc")
    (rec,) = journal.records()
    assert "hf_s3cr3tvalue" not in json.dumps(rec) and "abc" not in rec["MESSAGE"]
    assert rec["KIMI_API_KEY"] == "<redacted>"


def test_no_journal_falls_back_to_prefixed_stderr(tmp_path: Path) -> None:
    err = io.StringIO()
    JournalWriter(str(tmp_path / "absent.sock"), fallback=err).send(4, "warned", {})
    assert err.getvalue() == "<4>warned\n"


def test_console_and_json_formats() -> None:
    out = io.StringIO()
    configure("json", stream=out)
    get_logger().warning("health.failed", failures=1)
    record = json.loads(out.getvalue())
    assert record["event"] == "health.failed" and record["level"] == "warning" and record["failures"] == 1
    structlog.reset_defaults()


def test_journal_stream_detection(tmp_path: Path) -> None:
    f = open(tmp_path / "s", "w")  # noqa: SIM115
    st = os.fstat(f.fileno())
    assert journal_stream_is_stderr({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f)
    assert not journal_stream_is_stderr({"JOURNAL_STREAM": "1:2"}, f)
    assert not journal_stream_is_stderr({}, f)
    f.close()
    assert resolve_format("json") == "json"


def test_json_child_sink_matches_json_dumps() -> None:
    out = io.StringIO()
    sink = configure("json", stream=out)
    text = 'quote " backslash \\ tab \t ctl \x01 é \u2028 done'
    sink.line(text, 3, {"VLLM_COMPONENT": "Worker", "VLLM_RANK": "3"})
    sink.flush()
    expected = json.dumps(
        {"source": "child", "priority": 3, "line": text, "vllm_component": "Worker", "vllm_rank": "3"},
        ensure_ascii=False,
    )
    assert out.getvalue() == expected + "\n"
    structlog.reset_defaults()


def test_every_record_names_its_deployment(journal: JournalSocket) -> None:
    """Two deployments of one host in one journal: each record says whose it is, and no event's own field
    (an event with a `deployment` key, a child line) can say otherwise."""
    identity = {"SYSLOG_IDENTIFIER": "kimi-supervisor@kimi-a", "KIMI_DEPLOYMENT": "kimi-a"}
    sink = configure("journal", journal_socket=journal.path, identity=identity)
    get_logger().info("state.ready", deployment="kimi-b")
    sink.line("INFO hello", 6, {"KIMI_DEPLOYMENT": "kimi-b", "VLLM_COMPONENT": "APIServer"})
    records = journal.records()
    assert len(records) == 2
    for rec in records:
        assert rec["SYSLOG_IDENTIFIER"] == "kimi-supervisor@kimi-a" and rec["KIMI_DEPLOYMENT"] == "kimi-a"
