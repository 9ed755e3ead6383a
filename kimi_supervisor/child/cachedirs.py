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
<home> is `<dir>/uid-<uid>`, one per account the child runs as (root's is `uid-0`), made 0700 and owned by that
account through descriptors that follow no link (files/privdir.py).  Never the directory itself, and never a
name an account could choose: vLLM loads pickles and generated Python from there, so root's child must never
use a tree that `child.user` (the account that parses every client's request) could write, whatever that user
is called (a user named `vllm` once owned root's `<dir>/vllm`), nor one left behind when a deployment moves
from `user = "vllm"` to root (`CacheDirectory=` does not chown subdirectories).  An existing home owned by
another account, or writable by group or others, or a symlink, and a cache directory that is not root's
alone, refuse the start: exit 78 naming the path (CacheUntrusted; the operator removes it, the next start
makes it again and recompiles once).  When the cache directory does not exist (not under systemd, or no
`CacheDirectory=`), nothing is set: the supervisor does not create the unit's directories, and `--dry-run`
says so.  A dry run creates and chowns nothing: it says what a start would create.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.spawnplan import Identity, uid_gid
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.files import privdir
from kimi_supervisor.files.atomic import directory_problem

CUDA_CACHE_MAXSIZE = "4294967296"
_MARKER_DIRS = ("torch_compile_cache",)


def cache_home(directory: Path | None, identity: Identity | None) -> Path | None:
    """Where this child's caches go (not created here); None: no cache directory configured."""
    if directory is None:
        return None
    return directory / f"uid-{uid_gid(identity)[0]}"


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
    """The cache home cannot be made: the child keeps vLLM's defaults."""


class CacheUntrusted(ConfigError):
    """The cache home (or the directory above it) could be written by another account: the start is refused."""


def ensure_home(directory: Path, home: Path, identity: Identity | None, *, create: bool = True) -> bool:
    """Make `home` (`directory/uid-N`) for the child, or with `create` False only check it; True: it exists.

    Raises CacheUnusable (missing directory, mkdir failed) or CacheUntrusted (module docstring)."""
    try:
        st = os.stat(directory)
    except OSError:
        raise CacheUnusable(f"{directory} does not exist (the unit's CacheDirectory= creates it)") from None
    # Whoever may write the directory may rename a home away and put their own in its place after our check.
    problem = directory_problem(st, holds_our_files=True)
    if problem is not None:
        raise CacheUntrusted(f"paths.cache_directory: {directory} {problem}; the child's compiled code lives below it")
    uid, gid = uid_gid(identity)
    try:
        return privdir.private_dir(directory, home.name, uid, gid, create=create).exists
    except privdir.Refused as exc:
        raise CacheUntrusted(f"paths.cache_directory: cache home {exc.message}") from None
    except OSError as exc:
        raise CacheUnusable(f"cannot make {home} for {privdir.account_name(uid)}: {exc.strerror}") from None


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
    # A home that does not exist yet is made at the start: by root for any account, else for the supervisor's own.
    writable = exists and (_writable_by(home, identity) if home.is_dir() else os.geteuid() == 0 or identity is None)
    size, compiles = _size(home) if home.is_dir() else (0, 0)
    return CacheReport(home, exists, writable, size, compiles)


def check_cache(directory: Path | None, identity: Identity | None, env: Mapping[str, str]) -> Check:
    """The preflight's line about the caches (a warning never blocks a start)."""
    if directory is None:
        return Check("cache", Verdict.SKIP, 'paths.cache_directory = "": vLLM\'s caches follow HOME/XDG_CACHE_HOME')
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
            Verdict.WARN,
            f"{directory} does not exist (the unit's CacheDirectory= creates it): vLLM's compile cache follows HOME",
            data,
        )
    if not r.writable:
        return Check("cache", Verdict.WARN, f"{r.home} is not writable by {who}: every start would recompile", data)
    held = (
        f"holds {r.compile_caches} compile cache(s)"
        if r.compile_caches
        else "holds no compile cache yet (first start compiles)"
        if r.home is not None and r.home.is_dir()
        else "a start would create it (0700) and compile"
    )
    return Check("cache", Verdict.OK, f"{r.home} ({r.size_bytes / 1e6:.0f} MB) writable by {who}, {held}", data)
