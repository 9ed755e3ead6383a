"""TreeReadMeter: read_bytes summed over the tree, kept for members that exited; a rate over a window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.host import pagecache
from kimi_supervisor.host.procident import ProcIdent, identify
from kimi_supervisor.host.procio import TreeReadMeter, format_rate, read_bytes


def test_sums_members_and_keeps_the_ones_that_exited() -> None:
    counters = {1: 100, 2: 50}
    meter = TreeReadMeter(read=counters.get)
    a, b = ProcIdent(1, 1.0), ProcIdent(2, 2.0)
    assert meter.sample(0.0, [a, b]).total_bytes == 150
    counters[1], counters[2] = 300, 80
    assert meter.sample(1.0, [a, b]).total_bytes == 380
    del counters[2]  # b exited: its bytes were read all the same
    reads = meter.sample(2.0, [a])
    assert reads.total_bytes == 380 and reads.members == 2 and reads.unreadable == 0
    assert meter.rate() == 115.0  # 380 - 150 over 2 s


def test_a_member_we_may_not_read_is_counted_as_such() -> None:
    meter = TreeReadMeter(read=lambda pid: None)
    assert meter.sample(0.0, [ProcIdent(9, 9.0)]).unreadable == 1
    assert meter.rate() is None


def test_the_rate_window_moves() -> None:
    values = iter(range(0, 10_000, 100))
    meter = TreeReadMeter(read=lambda pid: next(values), window_s=3.0)
    ident = ProcIdent(1, 1.0)
    for t in range(10):
        meter.sample(float(t), [ident])
    assert meter.rate() == 100.0


def test_a_real_cold_read_shows_in_read_bytes(tmp_path: Path) -> None:
    f = tmp_path / "shard.safetensors"
    f.write_bytes(os.urandom(8 << 20))
    os.sync()
    pagecache.drop([f])
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; open(sys.argv[1], 'rb').read(); sys.stdin.read()", str(f)],
        stdin=subprocess.PIPE,
    )
    try:
        ident = identify(proc.pid)
        assert ident is not None
        meter = TreeReadMeter()
        from tests.conftest import wait_for

        wait_for(lambda: meter.sample(0.0, [ident]).total_bytes >= 8 << 20, timeout=30)
        assert (read_bytes(proc.pid) or 0) >= 8 << 20
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)


def test_format_rate() -> None:
    assert format_rate(1.0234e9) == "1.02 GB/s" and format_rate(250e6) == "250 MB/s" and format_rate(4080) == "4 kB/s"


def test_read_bytes_is_psutils_answer_and_none_for_what_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil (a dependency) reads /proc/PID/io: its answer, not a parser of our own (issue 50); its errors (gone,
    not ours) are None."""
    import psutil

    class Counters:
        read_bytes = 123_456

    monkeypatch.setattr(psutil.Process, "io_counters", lambda self: Counters())
    assert read_bytes(os.getpid()) == 123_456

    def denied(self: psutil.Process) -> None:
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "io_counters", denied)
    assert read_bytes(os.getpid()) is None
