"""How much of the model's shards the page cache holds: mincore(2) over a read-only mapping, sampled.

Mapping a file costs address space only (no read), and mincore answers from the page cache without touching
the storage.  Bounded for a 540 GB model (119 shards of ~4.5 GB, ~1.1 M pages each): a shard larger than
SAMPLE_WINDOWS x WINDOW_PAGES pages is sampled in SAMPLE_WINDOWS windows of WINDOW_PAGES pages spread evenly
over it (64 x 256 pages = 64 MiB of a 4.5 GB shard, a 16 KiB answer), so the cost is ~16 K pages a shard
whatever its size: ~2 M page lookups for the whole model, tens of milliseconds.  The fraction is the sampled
pages' (each shard weighted by its size); a small shard is checked whole.

Since Linux 5.2 mincore reports page-cache residency of a file only to its owner, to a process with write
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

from kimi_supervisor.config.file import file_kind

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
    every *.safetensors (default_loader.py:170-253).  A shard that resolves outside the model (`inside`) is
    left out: nothing here reads, maps or asks about a file the model does not hold."""
    try:
        names = index_names(model_dir)
    except ModelFileError:
        names = None
    if names is None:
        names = [p.name for p in model_dir.glob("*.safetensors")]
    bound = boundary(model_dir)
    paths = [model_dir / n for n in sorted(set(names), key=_natural_key)]
    return [p for p in paths if inside(p, bound)]


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    # vLLM's key is [str, int, str, ...]; tagging each part keeps mypy's comparisons honest and the order the same.
    return tuple((0, int(s)) if s.isdigit() else (1, s) for s in re.split(r"(\d+)", name))


INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # Kimi-K2's index is ~6 MB; a larger one is not an index


class ModelFileError(ValueError):
    """A file of the model cannot be used as vLLM would use it: `what` says why (one line, no bytes of the
    file but its JSON error's position), str() is `PATH: what`."""

    def __init__(self, path: Path | str, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path = str(path)
        self.what = what


def boundary(model_dir: Path) -> Path:
    """The directory every file of the model must resolve inside: the model directory's real path or, for a
    Hugging Face cache snapshot (`<cache>/models--ORG--NAME/snapshots/REV`, whose files link to
    `../../blobs/HASH`), that repository's directory: its blobs are the model's files, another repository's or
    anything else on the host are not."""
    real = Path(os.path.realpath(model_dir))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def inside(path: Path | str, bound: Path) -> bool:
    """Whether PATH, symlinks resolved, lies inside BOUND (a missing file: where it would be)."""
    real = os.path.realpath(path)
    return real == str(bound) or real.startswith(str(bound).rstrip("/") + "/")


def open_regular(path: Path, within: Path | None = None) -> int:
    """An fd to read the regular file at PATH, through symlinks (a Hugging Face snapshot links each file to its
    blob); a FIFO or a device is refused unopened (ModelFileError), and again on the fd if one was swapped in.
    WITHIN (a `boundary`): a file that resolves outside it is refused unopened, and the fd's own path is
    checked again after the open, so a link swapped in between cannot lead the read outside."""
    real = os.path.realpath(path)
    if within is not None and not inside(real, within):
        raise ModelFileError(path, f"resolves to {real}, outside the model ({within})")
    mode = os.stat(real).st_mode
    if not stat.S_ISREG(mode):
        raise ModelFileError(path, f"is {file_kind(mode)}, expected a regular file")
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    mode = os.fstat(fd).st_mode
    opened = _fd_path(fd)
    if not stat.S_ISREG(mode) or (within is not None and opened is not None and not inside(opened, within)):
        os.close(fd)
        why = f"is {file_kind(mode)}, expected a regular file" if not stat.S_ISREG(mode) else "changed under us"
        raise ModelFileError(path, why)
    return fd


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the check before the open stands alone
        return None


def read_index(path: Path, max_bytes: int = MAX_INDEX_BYTES, within: Path | None = None) -> bytes:
    """The shard index's bytes (open_regular); ModelFileError when it holds more than MAX_BYTES."""
    with open(open_regular(path, within), "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ModelFileError(path, f"larger than {max_bytes >> 20} MiB: not a shard index")
    return raw


def index_names(model_dir: Path) -> list[str] | None:
    """The shard file names MODEL_DIR's index maps its weights to (each once, the index's order), None without
    an index.  Whatever else the index is (unreadable, outside the model, not JSON, nested too deep, no
    `weight_map` object, a name that is not a string or holds a NUL): ModelFileError naming the index and
    what is wrong, never another exception."""
    index = model_dir / INDEX
    if not os.path.lexists(index):
        return None
    try:
        raw = read_index(index, within=boundary(model_dir))
    except OSError as exc:
        raise ModelFileError(index, exc.strerror or str(exc)) from None
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ModelFileError(index, "not a shard index (JSON nested too deep)") from None
    except ValueError as exc:  # not JSON, not UTF-8/16/32, an integer of more digits than Python converts
        raise ModelFileError(index, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise ModelFileError(index, f"not a shard index (a JSON {_json_type(doc)}, expected an object)")
    if "weight_map" not in doc:
        raise ModelFileError(index, "not a shard index (no weight_map)")
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict):
        raise ModelFileError(index, f"not a shard index (weight_map is a JSON {_json_type(weight_map)})")
    names: dict[str, None] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or "\0" in name:
            shown = repr(name)[:40] if isinstance(name, str) else f"a JSON {_json_type(name)}"
            raise ModelFileError(index, f"weight_map[{key[:80]!r}] is {shown}, expected a shard file name")
        names[name] = None
    return list(names)


def _json_type(value: object) -> str:
    for kind, word in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return word
    return "object" if isinstance(value, dict) else "null"
