"""Shared memory: unused matching files go, files open or mapped by a live process stay."""

from __future__ import annotations

from pathlib import Path

from kimi_supervisor.config.model import ShmConfig
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.shm import plan_shm, remove_stale
from tests.conftest import ProcSpawner

TABLE = PsutilProcessTable()


def cfg(directory: Path) -> ShmConfig:
    return ShmConfig(enabled=True, directory=directory, globs=("psm_*", "sem.mp-*", "nccl-*"))


def test_removes_only_unused_matching_files(tmp_path: Path, spawner: ProcSpawner) -> None:
    stale = tmp_path / "psm_stale"
    opened = tmp_path / "nccl-open"
    mapped = tmp_path / "sem.mp-mapped"
    other = tmp_path / "torch_123"  # does not match any glob
    for f in (stale, opened, mapped, other):
        f.write_bytes(b"x" * 4096)
    (tmp_path / "psm_dir").mkdir()
    holder = spawner.python(
        "import mmap, sys, time\n"
        f"f = open({str(opened)!r}, 'rb')\n"
        f"g = open({str(mapped)!r}, 'r+b'); m = mmap.mmap(g.fileno(), 4096); g.close()\n"
        "print('up', flush=True)\ntime.sleep(600)"
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"up\n"

    decisions = {d.path.name: d for d in plan_shm(cfg(tmp_path), TABLE)}
    assert set(decisions) == {"psm_stale", "nccl-open", "sem.mp-mapped", "psm_dir"}
    assert decisions["psm_stale"].remove
    assert decisions["nccl-open"].reason == f"in use by PID {holder.pid} (python3)"
    assert decisions["sem.mp-mapped"].reason == f"in use by PID {holder.pid} (python3)"
    assert not decisions["nccl-open"].remove and not decisions["sem.mp-mapped"].remove
    assert decisions["psm_dir"].reason == "not a regular file"

    outcome = remove_stale(list(decisions.values()))
    assert outcome.removed == (stale,)
    assert not stale.exists() and opened.exists() and mapped.exists() and other.exists()
    assert outcome.errors == ()


def test_missing_directory_is_nothing_to_do(tmp_path: Path) -> None:
    assert plan_shm(cfg(tmp_path / "absent"), TABLE) == []


def test_file_vanishing_between_plan_and_remove_is_not_an_error(tmp_path: Path) -> None:
    f = tmp_path / "psm_gone"
    f.write_bytes(b"")
    decisions = plan_shm(cfg(tmp_path), TABLE)
    f.unlink()
    outcome = remove_stale(decisions)
    assert outcome.removed == () and outcome.errors == ()
