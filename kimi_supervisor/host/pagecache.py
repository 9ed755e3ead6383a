"""How much of the model's shards the page cache holds: mincore(2) over a read-only mapping, sampled.

Mapping a file costs address space only (no read), and mincore answers from the page cache without touching
the storage.  Bounded for a 540 GB model (119 shards of ~4.5 GB, ~1.1 M pages each): a shard larger than
SAMPLE_WINDOWS x WINDOW_PAGES pages is sampled in SAMPLE_WINDOWS windows of WINDOW_PAGES pages spread evenly
over it (64 x 256 pages = 64 MiB of a 4.5 GB shard, a 16 KiB answer), so the cost is ~16 K pages a shard
whatever its size: ~2 M page lookups for the whole model, tens of milliseconds.  The fraction is the sampled
pages' (each shard weighted by its size); a small shard is checked whole.

Since Linux 5.2 mincore reports page-cache residency of a file only to its owner, to a holder of write
permission, or to root (CAP_FOWNER); anyone else is told only about pages they mapped themselves, i.e.
nothing.  Such a file is reported as unknown, never as 0% cached.

posix_fadvise(DONTNEED) (`drop`) is for the bench and the tests that need a cold start: the supervisor never
calls it on a model vLLM reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import mmap
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

SAMPLE_WINDOWS = 64
WINDOW_PAGES = 256
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclasses.dataclass(frozen=True)
class Residency:
    files: int
    total_bytes: int
    checked_bytes: int  # the bytes of the files we could ask about
    cached_bytes: float  # estimated from the samples
    unknown: tuple[str, ...] = ()  # files we may not ask about, or could not open

    @property
    def fraction(self) -> float | None:
        return self.cached_bytes / self.checked_bytes if self.checked_bytes else None


def may_ask(st: os.stat_result) -> bool:
    """mincore tells the truth about a file's cache to its owner, root, or a writer (Linux >= 5.2)."""
    uid = os.geteuid()
    return uid == 0 or st.st_uid == uid


def _windows(pages: int) -> list[tuple[int, int]]:
    """(first page, count) of the windows to ask about."""
    if pages <= SAMPLE_WINDOWS * WINDOW_PAGES:
        return [(0, pages)]
    stride = (pages - WINDOW_PAGES) / (SAMPLE_WINDOWS - 1)
    return [(round(i * stride), WINDOW_PAGES) for i in range(SAMPLE_WINDOWS)]


def file_residency(path: Path) -> tuple[int, float] | None:
    """(size, estimated cached bytes) of one file; None when we may not ask or cannot open it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (may_ask(st) or os.access(path, os.W_OK)):
            return None
        size = st.st_size
        if size == 0:
            return 0, 0.0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            pages = (size + PAGE - 1) // PAGE
            asked = resident = 0
            for first, count in _windows(pages):
                vec = ctypes.create_string_buffer(count)
                if _libc.mincore(addr + first * PAGE, count * PAGE, vec) != 0:
                    return None
                asked += count
                resident += sum(b & 1 for b in vec.raw)
            return size, size * resident / asked
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def residency(paths: Iterable[Path]) -> Residency:
    files = total = checked = 0
    cached = 0.0
    unknown: list[str] = []
    for path in paths:
        files += 1
        try:
            total += path.stat().st_size
        except OSError:
            unknown.append(str(path))
            continue
        answer = file_residency(path)
        if answer is None:
            unknown.append(str(path))
            continue
        checked += answer[0]
        cached += answer[1]
    return Residency(files, total, checked, cached, tuple(unknown))


def drop(paths: Iterable[Path]) -> None:
    """Ask the kernel to drop these files' clean pages (a cold start for a bench; dirty pages stay)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shards_in_load_order(model_dir: Path) -> list[Path]:
    """The shards vLLM 0.32 reads, in its order: the index's files, natural-sorted by base name
    (model_executor/model_loader/weight_utils.py:147 `_natural_sort_key`, :1098); without a readable index,
    every *.safetensors (default_loader.py:170-253)."""
    try:
        names = set(json.loads(read_index(model_dir / "model.safetensors.index.json"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = {p.name for p in model_dir.glob("*.safetensors")}
    return [model_dir / n for n in sorted(names, key=_natural_key)]


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    # vLLM's key is [str, int, str, ...]; tagging each part keeps mypy's comparisons honest and the order the same.
    return tuple((0, int(s)) if s.isdigit() else (1, s) for s in re.split(r"(\d+)", name))


def open_regular(path: Path) -> int:
    """An fd to read the regular file at PATH, through symlinks (a Hugging Face snapshot links each file to its
    blob); a FIFO or a device is refused unopened (ValueError), and again on the fd if one was swapped in."""
    real = os.path.realpath(path)
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise ValueError(f"{path} is not a regular file")
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return fd


def read_index(path: Path, max_bytes: int = 64 << 20) -> bytes:
    """The shard index's bytes (open_regular)."""
    with open(open_regular(path), "rb") as f:
        return f.read(max_bytes)
