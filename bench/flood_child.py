#!/usr/bin/env python3
"""Prints N lines of about 100 bytes to stdout as fast as it can; writes its elapsed seconds to a file.

    flood_child.py N ELAPSED_FILE
"""

from __future__ import annotations

import sys
import time

LINES_PER_WRITE = 1000


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    start = time.monotonic()
    stdout = sys.stdout.buffer
    pad = "x" * 60
    # Shaped like vLLM's lines, 104 bytes each with the newline; one chunk built once, written again and again.
    lines = [f"(Worker_TP{i % 8} pid=4242) INFO flood line {i:05d} {pad}\n".encode() for i in range(LINES_PER_WRITE)]
    chunk = b"".join(lines)
    done = 0
    while done < n:
        count = min(LINES_PER_WRITE, n - done)
        stdout.write(chunk if count == LINES_PER_WRITE else b"".join(lines[:count]))
        done += count
    stdout.flush()
    elapsed = time.monotonic() - start
    with open(out, "w") as fh:
        fh.write(repr(elapsed))


if __name__ == "__main__":
    main()
