"""The output path: the meter toward journald, and sinks that never block (real sockets, pipes, processes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kimi_supervisor.child.process import ChildProcess, SpawnSpec
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.fdwriter import FdWriter
from kimi_supervisor.journal import JournalChildSink, JournalWriter
from kimi_supervisor.output import ChildOutput, LineMeter
from testkit.fakes.clock import RecordingLog
from testkit.fakes.journal_socket import JournalSocket
from testkit.harness import FAKE

CFG = parse_config({"child": {"argv": ["vllm"]}}, Path("t.toml")).readiness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_budget_per_second_and_pool() -> None:
    clock = Clock()
    meter = LineMeter(per_s=3, clock=clock)
    assert [meter.admit(6) for _ in range(5)] == [True, True, True, False, False]
    assert meter.admit(5) is False  # NOTICE shares INFO's journald pool
    assert meter.admit(3) and meter.admit(4)  # ERR and WARNING pools have their own budget
    assert meter.take_suppressed() == 0  # reported once the second is over, not line by line
    clock.now += 1.0
    assert meter.take_suppressed() == 3
    assert meter.admit(6)
    assert meter.take_suppressed() == 0


def test_stalled_journal_drops_child_lines_and_keeps_every_supervisor_record(tmp_path: Path) -> None:
    journal = JournalSocket(tmp_path)  # reads only when asked: a stalled journald until then
    writer = JournalWriter(journal.path)
    sink = JournalChildSink(writer)
    sent = 0
    while not writer.dropped:  # fill journald's queue with child lines
        sink.line(f"child line {sent}", 6, {})
        sent += 1
        assert sent < 1_000_000
    for i in range(50):  # the supervisor's own records while journald is stalled: queued, never dropped
        writer.send(6, f"state.record {i}", {"KIMI_SOURCE": "supervisor"})
    for _ in range(100):
        sink.line("more child output", 6, {})
    assert writer.pending == 50 and writer.take_dropped() == 0  # no summary while the stall lasts
    received: list[dict[str, str]] = []
    while writer.pending:  # journald reads again
        received += journal.records()
        writer.flush()
    received += journal.records()
    records = [r["MESSAGE"] for r in received if r.get("KIMI_SOURCE") == "supervisor"]
    assert records == [f"state.record {i}" for i in range(50)]  # all of them, in order
    child = [r for r in received if r["MESSAGE"].startswith("child line")]
    dropped = writer.take_dropped()
    assert len(child) + dropped == sent + 100  # every child line is either delivered or counted
    assert writer.lost_records == 0


def test_pump_meters_child_lines_toward_journald_and_counts_the_rest(tmp_path: Path) -> None:
    """A real flooding child through the real pump: per second at most the budget; nothing uncounted."""
    journal = JournalSocket(tmp_path)
    writer = JournalWriter(journal.path)
    log = RecordingLog()
    lines = 60_000
    out = ChildOutput(JournalChildSink(writer), ReadinessTracker(CFG), log, meter=LineMeter(per_s=2000))
    spec = SpawnSpec(
        (sys.executable, str(FAKE), "serve", "/m", "--flood-only", "--flood-lines", str(lines)), {}, True, None, None
    )
    child = ChildProcess.spawn(spec, os.environ)
    out.attach(child)
    received: list[dict[str, str]] = []
    while out.streams_open:
        out.pump(0.05)
        received += journal.records()
    child.reap()
    out.finish(timeout_s=1)
    received += journal.records()
    flood = [r for r in received if "] flood line " in r["MESSAGE"]]
    suppressed = sum(int(f["lines"]) for f in log.events("child.suppressed"))  # type: ignore[call-overload]
    dropped = sum(int(f["lines"]) for f in log.events("child.dropped"))  # type: ignore[call-overload]
    assert suppressed > 0 and len(flood) < lines
    assert len(flood) + suppressed + dropped == lines
    assert all(int(f["budget_per_s"]) == 2000 for f in log.events("child.suppressed"))  # type: ignore[call-overload]


def test_fd_writer_bounds_a_stalled_pipe_and_reports_on_recovery() -> None:
    r, w = os.pipe()
    try:
        writer = FdWriter(w, limit=64 * 1024)
        line = b"x" * 99 + b"\n"
        written = sum(1 for _ in range(20_000) if writer.write(line))
        assert writer.dropped == 20_000 - written > 0
        assert writer.pending <= 64 * 1024 + len(line)
        assert writer.take_dropped() == 0  # still stalled
        got = 0
        while writer.pending or got == 0:
            got += len(os.read(r, 1 << 20))
            writer.flush()
        got += len(os.read(r, 1 << 20)) if writer.pending == 0 and _readable(r) else 0
        assert got == written * len(line)
        assert writer.take_dropped() == 20_000 - written
        os.close(r)
        r = -1
        writer.write(line)  # the reader left: EPIPE disables this writer, nothing raises
        assert writer.broken and writer.write(line) is False
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])
