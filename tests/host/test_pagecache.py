"""Residency by sampled mincore: the truth for files we may ask about, "unknown" for the rest, never 0%."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.host import pagecache

PAGE = pagecache.PAGE


def make(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    os.sync()
    return path


def test_cold_then_half_then_warm(tmp_path: Path) -> None:
    f = make(tmp_path / "a.safetensors", 256 * PAGE)
    pagecache.drop([f])
    assert pagecache.residency([f]).fraction == 0.0
    with open(f, "rb") as fh:
        fh.read(128 * PAGE)  # the first half, through read(): no readahead past the file's middle is assumed...
    half = pagecache.residency([f]).fraction
    assert half is not None and 0.5 <= half <= 1.0  # ...the kernel may read ahead, never less than asked
    f.read_bytes()
    r = pagecache.residency([f])
    assert r.fraction == 1.0 and r.total_bytes == r.checked_bytes == 256 * PAGE and r.unknown == ()


def test_a_large_file_is_sampled_in_windows_of_the_whole_file(tmp_path: Path) -> None:
    pages = pagecache.SAMPLE_WINDOWS * pagecache.WINDOW_PAGES * 2
    windows = pagecache._windows(pages)
    assert len(windows) == pagecache.SAMPLE_WINDOWS
    assert windows[0] == (0, pagecache.WINDOW_PAGES) and windows[-1] == (
        pages - pagecache.WINDOW_PAGES,
        pagecache.WINDOW_PAGES,
    )
    f = make(tmp_path / "big.safetensors", pages * PAGE)  # 128 MiB
    pagecache.drop([f])
    with open(f, "rb") as fh:  # the first quarter cached: the estimate says about a quarter
        fh.read(pages * PAGE // 4)
    frac = pagecache.residency([f]).fraction
    assert frac is not None and 0.2 <= frac <= 0.35


def test_a_file_we_may_not_ask_about_is_unknown_not_cold(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the probe as another user")
    f = make(tmp_path / "root-owned.safetensors", 16 * PAGE)
    f.chmod(0o644)
    tmp_path.chmod(0o755)
    f.read_bytes()
    probe = (
        "import json, sys; from pathlib import Path; from kimi_supervisor.host import pagecache; "
        "r = pagecache.residency([Path(sys.argv[1])]); print(json.dumps([r.fraction, list(r.unknown)]))"
    )
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", probe, str(f)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == [None, [str(f)]]


def test_load_order_is_vllms_natural_sort_of_the_index(tmp_path: Path) -> None:
    names = ["model-10-of-11.safetensors", "model-2-of-11.safetensors", "model-1-of-11.safetensors"]
    index = {"weight_map": {f"w{i}": n for i, n in enumerate(names)} | {"x": names[0]}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "stray.safetensors").write_bytes(b"")  # not in the index: vLLM drops it too
    got = [p.name for p in pagecache.shards_in_load_order(tmp_path)]
    assert got == ["model-1-of-11.safetensors", "model-2-of-11.safetensors", "model-10-of-11.safetensors"]


def test_a_fifo_for_an_index_is_never_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    (tmp_path / "model-1.safetensors").write_bytes(b"")
    assert [p.name for p in pagecache.shards_in_load_order(tmp_path)] == ["model-1.safetensors"]
