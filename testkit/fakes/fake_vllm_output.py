"""What the fake vLLM prints: excerpts of real vLLM 0.32 logs replayed as its own, and made-up stress.

The excerpts come from tests/fixtures/vllm_cpu_0.32 (captured from `vllm serve` on CPU), cut by marker
lines, so that the supervisor is tested against vLLM's real shapes: logger lines with a
"(Label pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] " prefix on stdout; tracebacks, uvicorn and tqdm on
stderr. A replayed line takes this process's label and PID and the current time; the fixture's model
path, URL and PIDs become the fake's.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from testkit.fakes.fake_vllm_proc import P, pause

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm_cpu_0.32"
# What the captured runs were started with (tests/e2e), replaced by the fake's own.
FIXTURE_MODEL = "/tmp/kimi-e2e/tiny-llama"
FIXTURE_URL = "http://127.0.0.1:18000"
FIXTURE_PORT = "'port': 18000"

_PREFIX = re.compile(r"\((?P<label>[\w-]+) pid=(?P<pid>\d+)\) ")
_STAMP = re.compile(r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")
_SERVER_PID = re.compile(r"server process \[\d+\]")
_IMPORTANT = ("ERROR", "CRITICAL")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # reader gone: keep running, like a daemon would
        view = view[n:]


def ts() -> str:
    return time.strftime("%m-%d %H:%M:%S")


def prefix() -> str:
    return f"({P.label} pid={P.pid}) "


def log(level: str, where: str, msg: str) -> None:
    """A vLLM logger line of this process, on stdout."""
    if P.quiet and level not in _IMPORTANT:
        return
    write_all(1, f"{prefix()}{level} {ts()} [{where}] {msg}\n".encode())


def plain(line: str, *, fd: int = 2, important: bool = False) -> None:
    if P.quiet and not important:
        return
    write_all(fd, f"{line}\n".encode())


# --------------------------------------------------------------------------------------------------
# replaying the fixtures


@functools.cache
def _fixture(name: str) -> tuple[str, ...]:
    # Bytes kept exactly (CRLF inside records, leading CR on progress lines): split on LF only.
    return tuple((FIXTURES / name).read_bytes().decode("utf-8").split("\n"))


def excerpt(name: str, first: str, last: str, *, nth: int = 0, labels: Iterable[str] | None = None) -> list[str]:
    """Lines of fixture `name` from the `nth` line containing `first` to the next containing `last`.

    With `labels`, prefixed lines of other processes are left out (the fixture interleaves them).
    """
    lines = _fixture(name)
    starts = [i for i, line in enumerate(lines) if first in line]
    if not starts:
        raise LookupError(f"{name}: no line contains {first!r}")
    start = starts[nth]
    end = next((i for i in range(start, len(lines)) if last in lines[i]), None)
    if end is None:
        raise LookupError(f"{name}: no line after {first!r} contains {last!r}")
    keep = set(labels) if labels is not None else None
    out = []
    for line in lines[start : end + 1]:
        m = _PREFIX.match(line)
        if keep is None or m is None or m["label"] in keep:
            out.append(line)
    return out


def as_own(line: str, subs: Mapping[str, str] = {}) -> tuple[int, str]:
    """(fd, text) of a fixture line printed by this process now."""
    for old, new in subs.items():
        line = line.replace(old, new)
    for old, new in _WHO.items():
        line = line.replace(old, new)
    line = _SERVER_PID.sub(f"server process [{P.pid}]", line)
    m = _PREFIX.match(line)
    if m is None:
        return 2, line
    rest = _STAMP.sub(lambda s: f"{s['level']} {ts()} ", line[m.end() :], count=1)
    return 1, prefix() + rest


def replay(lines: Sequence[str], subs: Mapping[str, str] = {}, *, important: bool = False) -> None:
    """Print fixture lines as this process's own, one write per stream run (as vLLM flushes)."""
    if P.quiet and not important:
        return
    runs: list[tuple[int, list[str]]] = []
    for line in lines:
        fd, text = as_own(line, subs)
        if runs and runs[-1][0] == fd:
            runs[-1][1].append(text)
        else:
            runs.append((fd, [text]))
    for fd, texts in runs:
        write_all(fd, "".join(t + "\n" for t in texts).encode())


# Set once by the APIServer before it forks: the fixture's model, URL and port become the fake's.
_WHO: dict[str, str] = {}


def identify(model: str, url: str, port: int) -> None:
    _WHO.update({FIXTURE_MODEL: model, FIXTURE_URL: url, FIXTURE_PORT: f"'port': {port}"})


# --------------------------------------------------------------------------------------------------
# progress, flood, malformed output


def _fmt_interval(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def bar_text(desc: str, n: int, total: int, elapsed: float) -> str:
    """vLLM's own bar_format for loading safetensors shards."""
    if n > 0 and elapsed > 0:
        rate = n / elapsed
        remaining = _fmt_interval((total - n) / rate)
        rate_s = f"{rate:5.2f}it/s" if rate >= 1 else f"{1 / rate:5.2f}s/it"
    else:
        remaining, rate_s = "?", "?it/s"
    return f"{desc}: {100.0 * n / total:3.0f}% Completed | {n}/{total} [{_fmt_interval(elapsed)}<{remaining}, {rate_s}]"


def load_shards(
    total: int, seconds: float, *, show: bool, fail_at: int | None = None, hold_until: str | None = None
) -> bool:
    """tqdm through a pipe (as in the fixtures): '\\r' + bar + '\\n' per update, a blank line at the
    end. False if loading stopped at shard `fail_at`. With `hold_until`, it stops after the first shard
    until that file exists."""
    desc = "Loading safetensors checkpoint shards"
    start = time.monotonic()
    for n in range(total + 1):
        if n:
            pause(seconds / total)
        if fail_at is not None and n == fail_at:
            return False
        if show and not P.quiet:
            write_all(2, f"\r{bar_text(desc, n, total, time.monotonic() - start)}\n".encode())
        while n == 1 and hold_until is not None and not os.path.exists(hold_until):
            pause(0.05)
    if show and not P.quiet:
        write_all(2, b"\n")
    return True


def flood(lines: int, line_bytes: int) -> None:
    """`lines` numbered logger lines on stdout, as fast as possible, in 64 KiB writes."""
    pre = f"{prefix()}INFO "
    chunk: list[str] = []
    size = 0
    stamp = ts()
    for i in range(lines):
        if i % 4096 == 0:
            stamp = ts()
        head = f"{pre}{stamp} [loggers.py:123] flood line {i:09d} "
        line = head + "x" * max(0, line_bytes - len(head) - 1) + "\n"
        chunk.append(line)
        size += len(line)
        if size >= 65536:
            write_all(1, "".join(chunk).encode())
            chunk, size = [], 0
    if chunk:
        write_all(1, "".join(chunk).encode())


def long_line(length: int, newline: bool) -> None:
    head = f"{prefix()}INFO {ts()} [tokenizer.py:101] long line: ".encode()
    if length <= len(head):
        head = b""
    write_all(1, head)
    left = length - len(head)
    chunk = b"L" * 65536
    while left > 0:
        write_all(1, chunk[: min(left, len(chunk))])
        left -= len(chunk)
    if newline:
        write_all(1, b"\n")


def invalid_utf8() -> None:
    head = f"{prefix()}WARNING {ts()} [tokenizer.py:88] ".encode()
    write_all(1, head + b"undecodable bytes: \xff\xfe \xc3\x28 \xed\xa0\x80 \xf0\x28\x8c\x28 end\n")
    write_all(2, b"\x80\x81 raw invalid bytes on stderr \xc0\xaf\n")
    head = f"{prefix()}INFO {ts()} [tokenizer.py:90] ".encode()
    write_all(1, head + b"split character: caf\xc3")
    time.sleep(0.01)
    write_all(1, b"\xa9 ok\n")
