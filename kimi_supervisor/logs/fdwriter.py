"""Writes to stdout/stderr that never block the loop: non-blocking fds, bounded buffers, counted drops.

A reader that stops reading (`kimi-supervisor | less` left in the pager, a wedged log shipper) used to
block the supervisor in write(): no more health probes, watchdog pings or signal handling, and the child
blocked behind it.  Now a write takes what the pipe accepts and buffers the rest up to a bound; past it,
child lines are dropped and counted (the caller says what may be dropped), the supervisor's own records
get a larger bound.  A reader that left (EPIPE) disables that writer only.  Terminals stay blocking: their
file description is shared with the login shell, and a terminal does not stall the way a pipe does.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import TextIO

CHILD_BUFFER = 256 * 1024  # child lines waiting for a slow reader; beyond: dropped, counted
RECORD_BUFFER = 4 * 1024 * 1024  # the supervisor's own records: far more than a stall's worth


class FdWriter:
    def __init__(self, fd: int, limit: int = CHILD_BUFFER) -> None:
        self.fd = fd
        self.limit = limit
        self.broken = False
        self.dropped = 0  # lines dropped while stalled, not yet reported
        self._buf = bytearray()
        self._was_blocking: bool | None = None
        try:
            if not os.isatty(fd) and os.get_blocking(fd):
                os.set_blocking(fd, False)
                self._was_blocking = True
        except OSError:
            pass

    @property
    def pending(self) -> int:
        return len(self._buf)

    def write(self, data: bytes, lines: int = 1, droppable: bool = True) -> bool:
        """Queue `data` (`lines` lines of it) and write what the fd takes now; False if dropped."""
        if self.broken:
            return False
        if self._buf and len(self._buf) + len(data) > (self.limit if droppable else RECORD_BUFFER):
            if droppable:
                self.dropped += lines
            return False
        self._buf += data
        self.flush()
        return True

    def flush(self) -> None:
        while self._buf and not self.broken:
            try:
                n = os.write(self.fd, self._buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EPIPE (the reader left), EBADF, EIO: this output is gone, the rest goes on
                self.broken = True
                self._buf.clear()
                return
            del self._buf[:n]

    def take_dropped(self, final: bool = False) -> int:
        """Lines dropped during a stall, once the stall is over (the buffer emptied) or at exit; else 0."""
        if not self.dropped or (self._buf and not final):
            return 0
        n, self.dropped = self.dropped, 0
        return n

    def finish(self, timeout_s: float) -> None:
        """At exit: give a slow reader up to `timeout_s` to take the rest, then leave it."""
        deadline = time.monotonic() + timeout_s
        self.flush()
        while self._buf and not self.broken:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # Not the reactor's (lifecycle/reactor.py): it waits for readers; this is one bounded wait for one fd to
            # take writes, at exit, after the loop has ended.
            with contextlib.suppress(OSError, ValueError):
                select.select([], [self.fd], [], min(left, 0.05))
            self.flush()

    def abandon(self) -> int:
        """At exit, after `finish`: give up the lines the reader never took, and count them as dropped (a line
        the reader got only part of counts too).  Left in the buffer, they would end with the process uncounted."""
        n = self._buf.count(b"\n") + (1 if self._buf and not self._buf.endswith(b"\n") else 0)
        self._buf.clear()
        self.dropped += n
        return n

    def close(self) -> None:
        if self._was_blocking:
            with contextlib.suppress(OSError):
                os.set_blocking(self.fd, True)
            self._was_blocking = None


class StreamWriter:
    """The same interface over a text stream without an fd (tests' StringIO): plain blocking writes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False
        self.dropped = 0
        self.pending = 0

    def write(self, data: bytes, lines: int = 1, droppable: bool = True) -> bool:
        if self.broken:
            return False
        try:
            self._stream.write(data.decode("utf-8", "replace"))
            self._stream.flush()
        except (OSError, ValueError):
            self.broken = True
            return False
        return True

    def flush(self) -> None:
        return None

    def take_dropped(self, final: bool = False) -> int:
        return 0

    def finish(self, timeout_s: float) -> None:
        return None

    def abandon(self) -> int:
        return 0  # every write has already happened

    def close(self) -> None:
        return None


Writer = FdWriter | StreamWriter


def writer_for(stream: TextIO, limit: int = CHILD_BUFFER) -> Writer:
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return StreamWriter(stream)
    with contextlib.suppress(OSError, ValueError):
        stream.flush()  # whatever Python buffered goes first
    return FdWriter(fd, limit)


class RecordStream:
    """A text file for structlog's PrintLogger whose writes go through a writer (never block, never raise)."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer

    def write(self, text: str) -> int:
        self.writer.write(text.encode("utf-8", "replace"), lines=text.count("\n"), droppable=False)
        return len(text)

    def flush(self) -> None:
        self.writer.flush()

    def isatty(self) -> bool:
        fd = getattr(self.writer, "fd", None)
        return fd is not None and os.isatty(fd)
