"""Shared-memory cleaning with hostile names and paths, openers of other users, and a partial view of /proc."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.config.model import ShmConfig
from kimi_supervisor.host.procfiles import maps_names
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.preflight.report import render_text
from kimi_supervisor.preflight.run import Preflight
from kimi_supervisor.preflight.shm import plan_shm, remove_stale, write_lease_granted
from kimi_supervisor.systemd import unit
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.log import RecordingLog
from tests.conftest import ProcSpawner
from tests.preflight.test_preflight import make_cfg

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="switching to nobody needs root")
TABLE = PsutilProcessTable()
# /root (pyenv's interpreter) is closed to nobody; the system python can mmap.
SYSTEM_PYTHON = "/usr/bin/python3"


def cfg(directory: Path | str) -> ShmConfig:
    return ShmConfig(enabled=True, directory=Path(directory), globs=("psm_*", "sem.mp-*", "nccl-*"))


def decisions(directory: Path | str, table: PsutilProcessTable = TABLE) -> dict[str, tuple[bool, str]]:
    return {d.path.name: (d.remove, d.reason) for d in plan_shm(cfg(directory), table)}


def hold(spawner: ProcSpawner, path: Path, *, mapped_only: bool = False, as_nobody: bool = False) -> int:
    if mapped_only:
        # Python's mmap keeps a dup of the fd; libc's mmap and a close leave only the mapping.
        code = (
            "import ctypes, os, time\n"
            "libc = ctypes.CDLL(None, use_errno=True); libc.mmap.restype = ctypes.c_void_p\n"
            "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]\n"
            f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
            "assert libc.mmap(None, 4096, 3, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)\n"
            "os.close(fd)\n"
            "print('up', flush=True); time.sleep(600)"
        )
        argv = [SYSTEM_PYTHON if as_nobody else "python3", "-c", code]
    else:
        argv = ["/bin/sh", "-c", 'exec 3<"$0"; echo up; exec sleep 600', str(path)]
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        user="nobody" if as_nobody else None,
    )
    spawner.procs.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"up\n", p.stderr.read() if p.stderr else ""
    fds = [os.readlink(f"/proc/{p.pid}/fd/{n}") for n in os.listdir(f"/proc/{p.pid}/fd")]
    assert (str(path) in fds) is not mapped_only
    return p.pid


def test_directory_through_a_symlink_or_dotdot_still_finds_the_opener(tmp_path: Path, spawner: ProcSpawner) -> None:
    # Before: /proc shows canonical paths, so through a symlink (or /dev/shm -> /run/shm) no opener was ever seen.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    held = real / "psm_held"
    held.write_bytes(b"x" * 4096)
    pid = hold(spawner, held)
    for given in (tmp_path / "link", f"{real}/../real", f"{tmp_path}/link/."):
        remove, reason = decisions(given)["psm_held"]
        assert (remove, reason) == (False, f"in use by PID {pid} (sleep)"), given


def test_mapped_only_file_with_a_newline_in_its_name_is_found_held(tmp_path: Path, spawner: ProcSpawner) -> None:
    # maps writes "\n" as the four bytes \012: before, the name never matched and the file was deleted.
    held = tmp_path / "psm_a\nb"
    held.write_bytes(b"x" * 4096)
    pid = hold(spawner, held, mapped_only=True)
    assert decisions(tmp_path)["psm_a\nb"] == (False, f"in use by PID {pid} (python3)")


def test_maps_names_read_both_ways() -> None:
    assert maps_names(b"/dev/shm/psm_x") == [b"/dev/shm/psm_x"]
    assert maps_names(b"/dev/shm/a\\012b") == [b"/dev/shm/a\\012b", b"/dev/shm/a\nb"]


@needs_root
def test_files_held_by_another_user_open_or_mapped_are_kept(open_dir: Path, spawner: ProcSpawner) -> None:
    opened, mapped, stale = open_dir / "nccl-open", open_dir / "sem.mp-mapped", open_dir / "psm_stale"
    for f in (opened, mapped, stale):
        f.write_bytes(b"x" * 4096)
        os.chown(f, 65534, 65534)
    pid_open = hold(spawner, opened, as_nobody=True)
    pid_map = hold(spawner, mapped, mapped_only=True, as_nobody=True)
    found = decisions(open_dir)
    assert found["nccl-open"] == (False, f"in use by PID {pid_open} (sleep)")
    assert found["sem.mp-mapped"] == (False, f"in use by PID {pid_map} (python3)")
    assert found["psm_stale"] == (True, "no live process has it open or mapped")


def test_opener_invisible_in_proc_is_caught_by_the_kernel(tmp_path: Path, spawner: ProcSpawner) -> None:
    # An empty proc root stands for hidepid / another PID namespace: the write lease still says "in use".
    held = tmp_path / "psm_held"
    held.write_bytes(b"x" * 4096)
    hold(spawner, held, mapped_only=True)
    blind = tmp_path / "proc"
    blind.mkdir()
    assert write_lease_granted(held) is False
    assert decisions(tmp_path, PsutilProcessTable(str(blind)))["psm_held"] == (
        False,
        "in use by a process /proc does not show (a write lease was refused)",
    )


@needs_root
def test_unreadable_proc_fails_closed(open_dir: Path) -> None:
    # A scan as nobody cannot read root's /proc/PID/fd, and nobody may not lease root's file: keep it, say why.
    unknown = open_dir / "psm_unknown"
    unknown.write_bytes(b"x")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = {d.path.name: [d.remove, d.reason] for d in plan_shm(cfg(open_dir), TABLE)}
            os.write(write_fd, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        result = json.loads(fh.read() or b"{}")
    os.waitpid(pid, 0)
    remove, reason = result["psm_unknown"]
    assert remove is False
    assert reason.startswith("openers unknown, kept: cannot read /proc/1/")
    assert reason.endswith("more processes)") and ": Permission denied" in reason
    assert unknown.exists()


def test_a_newline_in_a_file_name_cannot_fake_a_report_line(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    fake = "psm_x\nverdict: a start would proceed"
    (shm / fake).write_bytes(b"")
    config = make_cfg(tmp_path, gpus=[], check_port=False)
    report = Preflight(config, FakeGpuProbe([]), TABLE, FakeClock(), RecordingLog()).run(dry_run=True)
    text = render_text(report, str(tmp_path / "k.toml"))
    assert "psm_x\\x0averdict: a start would proceed: no live process has it open or mapped" in text
    assert [line for line in text.splitlines() if line.startswith("verdict")] == ["verdict: a start would proceed"]
    assert remove_stale(plan_shm(config.preflight.shm, TABLE)).removed == (shm / fake,)


def _lease_under_the_units_capabilities(path: Path) -> object:
    """write_lease_granted(path) in a root process holding only the unit's CapabilityBoundingSet."""
    lines = unit.render().replace("\\\n", "").splitlines()
    bounding = next(line.split("=", 1)[1] for line in lines if line.startswith("CapabilityBoundingSet="))
    caps = ",".join("+" + c.lower().removeprefix("cap_") for c in bounding.split())
    probe = f"from kimi_supervisor.preflight.shm import write_lease_granted as w; print(w({str(path)!r}))"
    # As root, an exec's permitted and effective sets become the bounding set: exactly what the unit grants.
    out = subprocess.run(
        ["setpriv", f"--bounding-set=-all,{caps}", "--", "python3", "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=Path(__file__).resolve().parents[2],  # the checkout's package, not an installed one
    )
    return {"True": True, "False": False, "None": None}[out.stdout.strip()]


@needs_root
def test_the_units_capabilities_let_the_lease_probe_answer_for_another_users_file(
    open_dir: Path, spawner: ProcSpawner
) -> None:
    # Before: without CAP_LEASE only the owner may lease, so for nobody's files the probe said "cannot tell"
    # and an opener hidden from /proc (hidepid, another PID namespace) left the verdict to the /proc scan.
    free, held = open_dir / "psm_free", open_dir / "psm_held"
    for path in (free, held):
        path.write_bytes(b"x" * 4096)
        os.chown(path, 65534, 65534)
    hold(spawner, held, mapped_only=True, as_nobody=True)
    assert _lease_under_the_units_capabilities(free) is True
    assert _lease_under_the_units_capabilities(held) is False
