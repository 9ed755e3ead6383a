"""Read the model's shards into the page cache while vLLM is not reading yet (`[readahead]`, off by default).

vLLM starts reading only after its imports, config, NCCL and model init (+21 s on the tiny CPU model, more with
8 GPU workers), and the supervisor knows the shards in vLLM's load order before the preflight starts
(pagecache.shards_in_load_order).  On a storage-bound host the head start is the saving; once vLLM reads, the
read-ahead only keeps a small window ahead of it.  The rules (docs/operators-view.md, "Read-ahead"):

* order: vLLM's (the index's shards, natural-sorted), one shard after the other, in CHUNK_BYTES read()s into one
  reused buffer: the pages land in the page cache, where vLLM's mmap finds them;
* pace: shard i is read only while i <= done + shards_ahead, `done` being the shards vLLM's progress line
  says it finished (`Loading safetensors checkpoint shards: 57% Completed | 68/119`); a shard vLLM has passed is
  never read (it would only push out pages still to come);
* memory: a chunk is read only while MemAvailable stays at least 10% of MemTotal plus (shards_ahead + 1) x the
  largest shard.  Page cache counts as available, so this guards against anonymous memory (vLLM's buffers,
  other tenants), and the window itself bounds what the read-ahead adds;
* never evicting: no POSIX_FADV_DONTNEED, no drop_caches, ever;
* stops when vLLM's weights are loaded, when the run leaves STARTING, on the first I/O error (logged by the
  caller from `reason`), or when every shard is read.

The decisions live in `step` (a fake clock and progress drive it in the tests); the thread only loops over it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

CHUNK_BYTES = 16 << 20  # vLLM's own prefetch block size (config/load.py:12-13)
RESERVE_FRACTION = 0.10
POLL_S = 0.2  # how often a waiting read-ahead looks again at vLLM's progress and MemAvailable


class Step(enum.Enum):
    READ = "read"
    WAIT_PROGRESS = "waiting for vLLM's progress"
    WAIT_MEMORY = "waiting for MemAvailable"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class MemInfo:
    total: int
    available: int


def read_meminfo() -> MemInfo:
    """MemTotal and MemAvailable, as psutil reads /proc/meminfo (a dependency already: no parser of our own)."""
    memory = psutil.virtual_memory()
    return MemInfo(memory.total, memory.available)


def read_chunk(path: Path, offset: int, buffer: bytearray) -> int:
    """Read up to len(buffer) bytes of `path` at `offset` (into the page cache); the count read."""
    # `path` is a shard's real path (for_model): a link swapped in for it later is not followed out of the model.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    try:
        return os.preadv(fd, [buffer], offset)
    finally:
        os.close(fd)


class ReadAhead:
    def __init__(
        self,
        shards: Sequence[tuple[Path, int]],  # (path, size) in vLLM's load order
        shards_ahead: int,
        *,
        meminfo: Callable[[], MemInfo] = read_meminfo,
        read: Callable[[Path, int, bytearray], int] = read_chunk,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._shards = list(shards)
        self._ahead = shards_ahead
        self._meminfo = meminfo
        self._read = read
        self._buffer = bytearray(chunk_bytes)
        largest = max((size for _, size in self._shards), default=0)
        self._window_bytes = (shards_ahead + 1) * largest
        self._index = 0  # the shard being read
        self._offset = 0
        self._done = 0  # shards vLLM reports finished
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_read = 0
        self.shards_read = 0
        self.memory_waits = 0
        self.reason: str | None = None  # why it stopped

    @classmethod
    def for_model(cls, model_dir: Path, shards_ahead: int) -> ReadAhead | None:
        """A read-ahead of `model_dir`'s shards in vLLM's order; None when it holds none we can stat.  Only shards
        that resolve inside the model are read (pagecache.shards_in_load_order), each at its real path."""
        from kimi_supervisor.host.pagecache import shards_in_load_order

        shards = []
        for path in shards_in_load_order(model_dir):
            try:
                real = Path(os.path.realpath(path))
                shards.append((real, real.stat().st_size))
            except OSError:
                return None  # the preflight's model check names it; vLLM will fail on it anyway
        return cls(shards, shards_ahead) if shards else None

    # -- what the loop tells it (any thread) -----------------------------------

    def progress(self, done: int) -> None:
        self._done = max(self._done, done)

    def finish(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._finished.set()

    # -- the decisions ------------------------------------------------------------

    def step(self) -> Step:
        """One decision, and at most one chunk read."""
        if self._finished.is_set():
            return Step.DONE
        if self._index < self._done:  # vLLM has passed it: never read behind vLLM
            self._index, self._offset = self._done, 0
        if self._index >= len(self._shards):
            self.finish("every shard read" if self._done < len(self._shards) else "vLLM read every shard")
            return Step.DONE
        if self._index > self._done + self._ahead:
            return Step.WAIT_PROGRESS
        mem = self._meminfo()
        if mem.available - len(self._buffer) < RESERVE_FRACTION * mem.total + self._window_bytes:
            self.memory_waits += 1
            return Step.WAIT_MEMORY
        path, size = self._shards[self._index]
        try:
            n = self._read(path, self._offset, self._buffer)
        except OSError as exc:
            self.finish(f"{path}: {exc.strerror or exc}")
            return Step.DONE
        self.bytes_read += n
        self._offset += n
        if n <= 0 or self._offset >= size:
            self._index, self._offset = self._index + 1, 0
            self.shards_read += 1
        return Step.READ

    # -- the thread -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kimi-readahead", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                step = self.step()
                if step is Step.DONE:
                    return
                if step is not Step.READ:
                    self._finished.wait(POLL_S)
        except Exception as exc:  # a help, never a reason to fail the start (ThreadWatch exits 70 on a raise)
            self.finish(f"{type(exc).__name__}: {exc}")

    def join(self, timeout_s: float) -> bool:
        """True when the thread has ended (it ends within one chunk of `finish`)."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
