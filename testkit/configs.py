"""Config files the tests and the benchmarks both build."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.config.file import MAX_BYTES as CONFIG_CAP


def largest_config(directory: Path) -> tuple[Path, int]:
    """Just under the loader's cap of a shape that builds many objects: `[preflight.reap] names`, an array of
    262k one-letter strings.  Returns the file and the array's length."""
    head = b'[child]\nargv = ["vllm"]\n[preflight.reap]\nnames = ['
    count = (CONFIG_CAP - len(head) - 2) // 4
    path = directory / "largest.toml"
    path.write_bytes(head + b'"a",' * count + b"]\n")
    return path, count
