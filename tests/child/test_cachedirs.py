"""The child's caches: pointed at the cache directory unless the operator chose, per user, never where missing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kimi_supervisor.checks import Status
from kimi_supervisor.child.cachedirs import cache_environment, check_cache
from kimi_supervisor.child.process import prepare_spawn
from kimi_supervisor.child.spawnplan import resolve_identity
from kimi_supervisor.config.model import SpawnSpec

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")


def spec(cache: Path | None, user: str | None = None, env: dict[str, str] | None = None) -> SpawnSpec:
    return SpawnSpec(("/bin/true",), env or {}, False, None, user, cache_directory=cache)


def test_every_cache_goes_under_the_home_unless_already_set() -> None:
    home = Path("/var/cache/kimi-supervisor")
    assert cache_environment(home, {}) == {
        "VLLM_CACHE_ROOT": "/var/cache/kimi-supervisor/vllm",
        "TORCHINDUCTOR_CACHE_DIR": "/var/cache/kimi-supervisor/torchinductor",
        "TRITON_CACHE_DIR": "/var/cache/kimi-supervisor/triton",
        "CUDA_CACHE_PATH": "/var/cache/kimi-supervisor/nv-compute",
        "CUDA_CACHE_MAXSIZE": "4294967296",
        "FLASHINFER_WORKSPACE_BASE": "/var/cache/kimi-supervisor",
    }
    chosen = cache_environment(home, {"TRITON_CACHE_DIR": "/fast/triton", "XDG_CACHE_HOME": "/srv/cache"})
    # XDG_CACHE_HOME is vLLM's own way to the root (envs.py:338): the operator chose, so no VLLM_CACHE_ROOT.
    assert "TRITON_CACHE_DIR" not in chosen and "VLLM_CACHE_ROOT" not in chosen and "CUDA_CACHE_PATH" in chosen


def test_the_supervisors_own_user_gets_the_directory_itself(tmp_path: Path) -> None:
    prepared = prepare_spawn(spec(tmp_path, env={"CUDA_CACHE_PATH": "/mine"}), {"PATH": "/usr/bin:/bin"})
    assert prepared.env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm") and prepared.env["CUDA_CACHE_PATH"] == "/mine"
    assert prepared.cache_note is None


def test_a_missing_directory_sets_nothing_and_says_why(tmp_path: Path) -> None:
    prepared = prepare_spawn(spec(tmp_path / "absent"), {"PATH": "/usr/bin:/bin"})
    assert "VLLM_CACHE_ROOT" not in prepared.env and "TRITON_CACHE_DIR" not in prepared.env
    assert prepared.cache_note is not None and "does not exist" in prepared.cache_note
    assert not (tmp_path / "absent").exists()


def test_no_cache_directory_leaves_vllms_defaults() -> None:
    prepared = prepare_spawn(spec(None), {"PATH": "/usr/bin:/bin"})
    assert "VLLM_CACHE_ROOT" not in prepared.env and prepared.cache_note is None


@ROOT_ONLY
def test_another_user_gets_a_directory_of_its_own(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    prepared = prepare_spawn(spec(tmp_path, user="nobody"), {"PATH": "/usr/bin:/bin"})
    home = tmp_path / "nobody"
    st = home.stat()
    assert st.st_uid == 65534 and stat.S_IMODE(st.st_mode) == 0o700
    assert prepared.env["VLLM_CACHE_ROOT"] == str(home / "vllm") and prepared.env["HOME"] == "/nonexistent"


@ROOT_ONLY
def test_a_home_owned_by_someone_else_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "nobody").mkdir(mode=0o700)  # root's, not nobody's: the child could not write it
    prepared = prepare_spawn(spec(tmp_path, user="nobody"), {"PATH": "/usr/bin:/bin"})
    assert "VLLM_CACHE_ROOT" not in prepared.env and "not a directory owned by" in (prepared.cache_note or "")


def test_the_dry_run_line_reports_size_writability_and_compile_caches(tmp_path: Path) -> None:
    missing = check_cache(tmp_path / "absent", None, {})
    assert missing.status is Status.WARN and "CacheDirectory=" in missing.message
    aot = tmp_path / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "b514c290"
    aot.mkdir(parents=True)
    (aot / "model").write_bytes(b"x" * 2_000_000)
    ok = check_cache(tmp_path, None, {})
    assert ok.status is Status.OK and ok.data["compile_caches"] == 1 and ok.data["bytes"] == 2_000_000
    assert "holds 1 compile cache(s)" in ok.message and ok.data["writable"]


@ROOT_ONLY
def test_the_dry_run_says_when_the_childs_user_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "nobody").mkdir(mode=0o755)  # root's: nobody cannot write it
    identity = resolve_identity("nobody", None)
    check = check_cache(tmp_path, identity, {})
    assert check.status is Status.WARN and "not writable by user 'nobody'" in check.message


@ROOT_ONLY
def test_a_symlink_planted_at_the_users_home_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (tmp_path / "nobody").symlink_to(victim)
    prepared = prepare_spawn(spec(tmp_path, user="nobody"), {"PATH": "/usr/bin:/bin"})
    assert "VLLM_CACHE_ROOT" not in prepared.env and victim.stat().st_uid == 0
