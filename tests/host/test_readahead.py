"""ReadAhead: vLLM's order, a bounded window ahead of its progress, only with memory to spare, never behind it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kimi_supervisor.host import pagecache
from kimi_supervisor.host.readahead import MemInfo, ReadAhead, Step
from tests.conftest import wait_for

GIB = 1 << 30
PLENTY = MemInfo(total=100 * GIB, available=90 * GIB)


class Reads:
    """A fake storage that records what was read: (shard name, offset)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, path: Path, offset: int, buffer: bytearray) -> int:
        self.calls.append((path.name, offset))
        return len(buffer)


def shards(n: int, size: int) -> list[tuple[Path, int]]:
    return [(Path(f"model-{i + 1:05d}-of-{n:05d}.safetensors"), size) for i in range(n)]


def run_until_wait(ra: ReadAhead) -> Step:
    for _ in range(1000):
        step = ra.step()
        if step is not Step.READ:
            return step
    raise AssertionError("never waited")


def test_reads_in_order_and_stays_within_the_window() -> None:
    reads = Reads()
    ra = ReadAhead(shards(6, 4), shards_ahead=2, meminfo=lambda: PLENTY, read=reads, chunk_bytes=2)
    assert run_until_wait(ra) is Step.WAIT_PROGRESS
    # vLLM on shard 0: shards 0, 1, 2 (two ahead), two chunks each, in order; shard 3 untouched.
    names = [name for name, _ in reads.calls]
    assert names == [p.name for p, _ in shards(6, 4)[:3] for _ in range(2)]
    assert [off for _, off in reads.calls] == [0, 2] * 3
    ra.progress(1)
    assert run_until_wait(ra) is Step.WAIT_PROGRESS
    assert reads.calls[-1][0].startswith("model-00004") and ra.shards_read == 4


def test_never_reads_a_shard_vllm_has_passed() -> None:
    reads = Reads()
    ra = ReadAhead(shards(8, 4), shards_ahead=1, meminfo=lambda: PLENTY, read=reads, chunk_bytes=4)
    ra.progress(5)  # vLLM raced ahead (a warm cache) before the read-ahead read anything
    run_until_wait(ra)
    assert [name[:11] for name, _ in reads.calls] == ["model-00006", "model-00007"]


def test_waits_while_memavailable_leaves_no_room_and_goes_on_when_it_does() -> None:
    reads = Reads()
    mem = {"now": MemInfo(total=100 * GIB, available=10 * GIB)}  # 10% reserve + 3 x 1 GiB shards: no room
    ra = ReadAhead(shards(4, GIB), shards_ahead=2, meminfo=lambda: mem["now"], read=reads, chunk_bytes=GIB)
    assert ra.step() is Step.WAIT_MEMORY and reads.calls == [] and ra.memory_waits == 1
    mem["now"] = MemInfo(total=100 * GIB, available=14 * GIB)  # 10 + 3 reserved, 1 GiB chunk: just room
    assert ra.step() is Step.READ and reads.calls == [("model-00001-of-00004.safetensors", 0)]


def test_finish_stops_it_before_the_next_chunk() -> None:
    reads = Reads()
    ra = ReadAhead(shards(4, 8), shards_ahead=3, meminfo=lambda: PLENTY, read=reads, chunk_bytes=2)
    assert ra.step() is Step.READ
    ra.finish("weights loaded")
    assert ra.step() is Step.DONE and len(reads.calls) == 1 and ra.reason == "weights loaded"


def test_ends_when_vllm_has_read_every_shard() -> None:
    reads = Reads()
    ra = ReadAhead(shards(3, 2), shards_ahead=1, meminfo=lambda: PLENTY, read=reads, chunk_bytes=2)
    ra.progress(3)
    assert ra.step() is Step.DONE and reads.calls == [] and ra.reason == "vLLM read every shard"


def test_an_io_error_ends_it_with_the_reason() -> None:
    def broken(path: Path, offset: int, buffer: bytearray) -> int:
        raise OSError(5, "Input/output error")

    ra = ReadAhead(shards(2, 2), shards_ahead=1, meminfo=lambda: PLENTY, read=broken, chunk_bytes=2)
    assert ra.step() is Step.DONE and "Input/output error" in (ra.reason or "")


def test_real_files_land_in_the_page_cache_and_the_thread_ends(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        p = tmp_path / f"model-{i + 1:05d}-of-00003.safetensors"
        p.write_bytes(os.urandom(1 << 20))
        files.append(p)
    os.sync()
    pagecache.drop(files)
    assert pagecache.residency(files).fraction == 0.0  # the cold start this test needs
    ra = ReadAhead([(p, p.stat().st_size) for p in files], shards_ahead=1, chunk_bytes=256 << 10)
    ra.start()
    wait_for(lambda: ra.shards_read == 2)  # vLLM on shard 0, one ahead: shards 0 and 1, then it waits
    assert not ra.join(0)
    assert pagecache.residency(files[:2]).fraction == 1.0
    assert pagecache.residency(files[2:]).fraction == 0.0
    ra.finish("weights loaded")
    assert ra.join(10) and ra.reason == "weights loaded" and ra.bytes_read == 2 << 20


def test_a_bug_in_the_thread_ends_the_readahead_not_the_run() -> None:
    def buggy(path: Path, offset: int, buffer: bytearray) -> int:
        raise RuntimeError("a bug")

    ra = ReadAhead(shards(2, 2), shards_ahead=1, meminfo=lambda: PLENTY, read=buggy, chunk_bytes=2)
    ra.start()
    assert ra.join(10) and ra.reason == "RuntimeError: a bug"


def test_meminfo_is_psutils_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil (a dependency) reads /proc/meminfo: MemTotal and MemAvailable are its total and available (issue 50)."""
    import collections

    import psutil

    from kimi_supervisor.host.readahead import read_meminfo

    memory = collections.namedtuple("memory", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(100 * GIB, 42 * GIB))
    assert read_meminfo() == MemInfo(total=100 * GIB, available=42 * GIB)
