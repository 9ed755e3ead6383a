"""Bytes-level scans over a block of the child's output: which lines need a look one at a time.

A flooding vLLM writes hundreds of MB a second; the supervisor cannot decode, classify and match each
line in Python at that rate (about 2 µs a line), and a slower reader blocks the child in write(2).  Most
flood lines are "plain": `(Comp pid=N) INFO ...` records or uvicorn's bare `INFO:` access lines.  For a
plain line the full path provably does nothing but count it (and forward it when the meter admits it):

- childlog gives it priority 6 (INFO's journald pool): it starts with `(` and every `)` in it is followed by
  ` INFO `, so if `_PREFIX` matches (its component, rank and pid hold no `)`: its `)` is the line's first)
  the level is INFO, and if not, a line starting with `(` is neither a traceback nor an exception line;
  or it starts with `INFO:` (`_BARE_LEVEL`: INFO);
- so it is never ERROR+ nor a traceback: no fatal pattern nor root cause sees it (readiness.feed);
- after READY nothing else does; while starting a line also needs one of the tracker's literal words
  (`ReadinessTracker.prefilter`) before any phase, progress or started pattern looks at it.

Two C-level searches over the block find the first line that may not be plain; blocks holding a `\\r`
(tqdm redraws: another line split), a known secret (the text that redaction would change), or a line over
the splitter's cut are left to the full path whole.
"""

from __future__ import annotations

import re

# A line start (after its \n) that is neither `(` nor `INFO:`; a `)` not followed by ` INFO `.  A line
# that starts with `(` and whose every `)` is followed by ` INFO ` is an INFO record if it is a record at
# all (its first `)` ends vLLM's prefix), else "other" at INFO.  Two searches with a literal first byte run
# at 2-3 GB/s; one regex that checks the prefix on every line runs at 0.9.
_BAD_START = re.compile(rb"\n(?!\(|INFO:)")
_BAD_CLOSE = re.compile(rb"\)(?! INFO )")


def bad_start(data: bytes, start: int, end: int) -> int:
    """The first line of data[start:end] (whole lines, data[start - 1] == \\n) that starts with neither `(`
    nor `INFO:`; `end` when none does."""
    # endpos end - 1: the block's last \n starts the next block's first line, not one of this block.
    m = _BAD_START.search(data, start - 1, end - 1)
    return end if m is None else m.start() + 1


def line_of(rx: re.Pattern[bytes], data: bytes, start: int, end: int) -> int:
    """The start of the first line of data[start:end] holding a match of `rx`; `end` when none does."""
    m = rx.search(data, start, end)
    return end if m is None else data.rfind(b"\n", start, m.start()) + 1 or start


def bad_close(data: bytes, start: int, end: int) -> int:
    """The first line of data[start:end] with a `)` not followed by ` INFO `; `end` when none has."""
    return line_of(_BAD_CLOSE, data, start, end)


def has_long_line(data: bytes, start: int, end: int, limit: int) -> bool:
    """Whether a line of data[start:end] (whole lines) is longer than `limit` bytes: one memrchr per
    `limit` bytes, since a window of limit + 1 bytes from a line's start must hold its \\n."""
    pos = start
    while end - pos > limit:
        nl = data.rfind(b"\n", pos, pos + limit + 1)
        if nl < 0:
            return True
        pos = nl + 1
    return False


def line_end_after(data: bytes, start: int, end: int, count: int) -> int:
    """The offset just past the `count`-th \\n of data[start:end] (`end` if it has fewer)."""
    pos = start
    for _ in range(count):
        nl = data.find(b"\n", pos, end)
        if nl < 0:
            return end
        pos = nl + 1
    return pos


def last_lines_start(data: bytes, start: int, end: int, count: int) -> int:
    """The offset of the last `count` lines of data[start:end] (whole lines)."""
    pos = end - 1  # the last line's \n
    for _ in range(count):
        nl = data.rfind(b"\n", start, pos)
        if nl < 0:
            return start
        pos = nl
    return pos + 1


# Literal characters and escaped punctuation, `|` between words: nothing whose meaning differs in bytes.
_WORD = r"(?:[^\\|()\[\]{}.*+?^$\ufffd]|\\[^A-Za-z0-9])+"
_WORDS = re.compile(f"{_WORD}(?:\\|{_WORD})*")


def literal_scan(prefilter: re.Pattern[str] | None) -> re.Pattern[bytes] | None:
    """The tracker's literal words (`Loading|Model|...`, escaped) as one bytes regex: a word is in a line's
    text iff its UTF-8 is in the line's bytes (`replace` decoding adds U+FFFD only, never a word's bytes).
    None when the prefilter is not plain words (a class or escape would mean another thing in bytes)."""
    if prefilter is None or prefilter.flags & (re.IGNORECASE | re.VERBOSE) or not _WORDS.fullmatch(prefilter.pattern):
        return None
    return re.compile(prefilter.pattern.encode("utf-8"))
