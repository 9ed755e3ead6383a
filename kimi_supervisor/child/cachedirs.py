"""Caches that survive every restart, whoever the child runs as.

vLLM 0.32 keeps its torch.compile / AOT artefacts, the FlashInfer autotune cache, the startup plan and the P2P
check cache under VLLM_CACHE_ROOT, which defaults to $XDG_CACHE_HOME/vllm, else ~/.cache/vllm (vllm/envs.py:
338-342, 712-717).  A `child.user` without a home (`nobody`: /nonexistent), a future `ProtectHome=`, or a
private /tmp makes every start recompile: minutes at TP=8.  So the child's environment points the caches at the
unit's `CacheDirectory=` (`paths.cache_directory`, /var/cache/kimi-supervisor):

    VLLM_CACHE_ROOT          <home>/vllm          unless VLLM_CACHE_ROOT or XDG_CACHE_HOME is already set
    TORCHINDUCTOR_CACHE_DIR  <home>/torchinductor (torch's default is /tmp/torchinductor_<user>; vLLM points
                                                   its own compiles beside its cache, compiler_interface.py:466)
    TRITON_CACHE_DIR         <home>/triton        (default ~/.triton/cache)
    CUDA_CACHE_PATH          <home>/nv-compute    (the driver's PTX JIT cache, default ~/.nv/ComputeCache)
    CUDA_CACHE_MAXSIZE       4294967296           (the driver's default, 1 GiB, is too small for TP=8 kernels)
    FLASHINFER_WORKSPACE_BASE <home>              (FlashInfer's JIT, default ~/.cache/flashinfer; newer
                                                   FlashInfer releases read it, older ones ignore it)

Each only when neither `child.env` nor the environment the child inherits sets it: an operator's choice wins.
<home> is the cache directory itself when the child runs as the supervisor's user, else `<dir>/<user>`, made
0700 and owned by that user (the supervisor runs as root then: it could not drop privileges otherwise), so a
child that runs as `nobody` can write it and another user's cache is never mixed in.  When the cache directory
does not exist (not under systemd, or no `CacheDirectory=`), nothing is set: the supervisor does not create
the unit's directories, and `--dry-run` says so.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from kimi_supervisor.checks import Check, Status
from kimi_supervisor.child.spawnplan import Identity

CUDA_CACHE_MAXSIZE = "4294967296"
_MARKER_DIRS = ("torch_compile_cache",)


def cache_home(directory: Path | None, identity: Identity | None) -> Path | None:
    """Where this child's caches go (not created here); None: no cache directory configured."""
    if directory is None:
        return None
    if identity is None or identity.uid == os.geteuid():
        return directory
    return directory / identity.user


def cache_environment(home: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the child's `env` (the rule in the module docstring)."""
    wanted = {
        "TORCHINDUCTOR_CACHE_DIR": str(home / "torchinductor"),
        "TRITON_CACHE_DIR": str(home / "triton"),
        "CUDA_CACHE_PATH": str(home / "nv-compute"),
        "CUDA_CACHE_MAXSIZE": CUDA_CACHE_MAXSIZE,
        "FLASHINFER_WORKSPACE_BASE": str(home),
    }
    if "VLLM_CACHE_ROOT" not in env and "XDG_CACHE_HOME" not in env:
        wanted["VLLM_CACHE_ROOT"] = str(home / "vllm")
    return {k: v for k, v in wanted.items() if k not in env}


class CacheUnusable(Exception):
    """The cache home cannot be made or is not the child's: the child keeps vLLM's defaults."""


def ensure_home(directory: Path, home: Path, identity: Identity | None) -> None:
    """Make `home` (a per-user directory under `directory`) for the child; raises CacheUnusable."""
    if not directory.is_dir():
        raise CacheUnusable(f"{directory} does not exist (the unit's CacheDirectory= creates it)")
    if home == directory or identity is None:
        return
    made = False
    try:
        os.mkdir(home, 0o700)
        made = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheUnusable(f"cannot make {home} for user {identity.user!r}: {exc.strerror}") from None
    # Through a descriptor opened without following links: a name swapped for a symlink after the mkdir
    # cannot steer the chown (root's) to another file.
    try:
        fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise CacheUnusable(f"{home} is not a directory owned by user {identity.user!r}") from None
    try:
        if made:
            os.fchown(fd, identity.uid, identity.gid)
        st = os.fstat(fd)
    except OSError as exc:
        raise CacheUnusable(f"cannot give {home} to user {identity.user!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != identity.uid:
        raise CacheUnusable(f"{home} is not a directory owned by user {identity.user!r}")


@dataclasses.dataclass(frozen=True)
class CacheReport:
    home: Path | None
    exists: bool
    writable: bool
    size_bytes: int
    compile_caches: int  # torch_compile_cache/<hash> entries under the vLLM root (one per model+config)


def _writable_by(path: Path, identity: Identity | None) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    uid = os.geteuid() if identity is None else identity.uid
    groups = {os.getegid(), *os.getgroups()} if identity is None else {identity.gid, *identity.groups}
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR and st.st_mode & stat.S_IXUSR)
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_IXOTH)


def _size(path: Path, limit: int = 200_000) -> tuple[int, int]:
    """(bytes, compile-cache entries) under `path`, walking at most `limit` entries."""
    total = entries = compiles = 0
    for root, dirs, files in os.walk(path):
        for name in files:
            entries += 1
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
        if os.path.basename(root) in _MARKER_DIRS:
            compiles += sum(1 for d in dirs if d != "torch_aot_compile")
            if "torch_aot_compile" in dirs:
                compiles += len(os.listdir(os.path.join(root, "torch_aot_compile")))
        if entries > limit:
            break
    return total, compiles


def report(directory: Path | None, identity: Identity | None) -> CacheReport:
    home = cache_home(directory, identity)
    if home is None:
        return CacheReport(None, False, False, 0, 0)
    exists = directory is not None and directory.is_dir()
    # A per-user home that does not exist yet is made by the supervisor (root) at the start.
    writable = exists and (_writable_by(home, identity) if home.is_dir() else os.geteuid() == 0)
    size, compiles = _size(home) if home.is_dir() else (0, 0)
    return CacheReport(home, exists, writable, size, compiles)


def check_cache(directory: Path | None, identity: Identity | None, env: Mapping[str, str]) -> Check:
    """The preflight's line about the caches (a warning never blocks a start)."""
    if directory is None:
        return Check("cache", Status.SKIP, 'paths.cache_directory = "": vLLM\'s caches follow HOME/XDG_CACHE_HOME')
    r = report(directory, identity)
    data = {
        "directory": str(r.home),
        "exists": r.exists,
        "writable": r.writable,
        "bytes": r.size_bytes,
        "compile_caches": r.compile_caches,
        "environment": cache_environment(r.home, env) if r.home else {},
    }
    who = f"user {identity.user!r}" if identity else "the supervisor's user"
    if not r.exists:
        return Check(
            "cache",
            Status.WARN,
            f"{directory} does not exist (the unit's CacheDirectory= creates it): vLLM's compile cache follows HOME",
            data,
        )
    if not r.writable:
        return Check("cache", Status.WARN, f"{r.home} is not writable by {who}: every start would recompile", data)
    held = (
        f"holds {r.compile_caches} compile cache(s)"
        if r.compile_caches
        else "holds no compile cache yet (first start compiles)"
    )
    return Check("cache", Status.OK, f"{r.home} ({r.size_bytes / 1e6:.0f} MB) writable by {who}, {held}", data)
