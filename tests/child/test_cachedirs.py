"""The child's caches: pointed at the cache directory unless the operator chose, per user, never where missing."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.checks import Verdict
from kimi_supervisor.child import process
from kimi_supervisor.child.cachedirs import CacheUntrusted, cache_environment, check_cache
from kimi_supervisor.child.process import prepare_spawn
from kimi_supervisor.child.spawnplan import Identity, resolve_identity
from kimi_supervisor.config.model import SpawnSpec
from testkit.harness import fake_sections, write_config

REPO = Path(__file__).resolve().parents[2]

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
NOBODY = pwd.getpwnam("nobody").pw_uid


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


def test_the_supervisors_own_user_gets_a_home_named_by_its_uid(tmp_path: Path) -> None:
    prepared = prepare_spawn(spec(tmp_path, env={"CUDA_CACHE_PATH": "/mine"}), {"PATH": "/usr/bin:/bin"})
    home = tmp_path / f"uid-{os.geteuid()}"
    assert prepared.env["VLLM_CACHE_ROOT"] == str(home / "vllm") and prepared.env["CUDA_CACHE_PATH"] == "/mine"
    assert prepared.cache_note is None and stat.S_IMODE(home.stat().st_mode) == 0o700


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
    home = tmp_path / f"uid-{NOBODY}"
    st = home.stat()
    assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o700
    assert prepared.env["VLLM_CACHE_ROOT"] == str(home / "vllm") and prepared.env["HOME"] == "/nonexistent"


@ROOT_ONLY
def test_a_child_user_named_vllm_never_gets_roots_vllm_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was (docs/operators-view.md): root's VLLM_CACHE_ROOT was <cache>/vllm, so a user `vllm` got <cache>/vllm
    as its home, made and chowned to it: root then loaded compiled code that account could write."""
    vllm = _user_named_vllm(monkeypatch)
    as_vllm = prepare_spawn(spec(tmp_path, user=vllm), {"PATH": "/usr/bin:/bin"})
    as_root = prepare_spawn(spec(tmp_path), {"PATH": "/usr/bin:/bin"})
    root_tree = Path(as_root.env["VLLM_CACHE_ROOT"])
    vllm_home = Path(as_vllm.env["VLLM_CACHE_ROOT"]).parent
    assert vllm_home.stat().st_uid == NOBODY
    # No directory on root's cache path, from its VLLM_CACHE_ROOT up to the cache directory, is anyone else's.
    assert vllm_home != root_tree and vllm_home not in root_tree.parents
    for directory in (d for d in [root_tree, *root_tree.parents] if d.exists() and tmp_path in [d, *d.parents]):
        st = directory.stat()
        assert st.st_uid == 0 and not st.st_mode & 0o022, directory


@ROOT_ONLY
def test_moving_a_deployment_from_user_vllm_to_root_never_hands_root_the_vllm_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was (docs/operators-view.md): `CacheDirectory=` does not chown subdirectories, so the tree `user = "vllm"` filled
    stayed vllm's when the deployment moved to root, and root's child loaded it."""
    vllm = _user_named_vllm(monkeypatch)
    vllm_uid = NOBODY
    before = prepare_spawn(spec(tmp_path, user=vllm), {"PATH": "/usr/bin:/bin"})
    tree = Path(before.env["VLLM_CACHE_ROOT"]) / "torch_compile_cache"
    tree.mkdir(parents=True)
    os.chown(tree, vllm_uid, vllm_uid)
    after = prepare_spawn(spec(tmp_path), {"PATH": "/usr/bin:/bin"})  # the same deployment, now as root
    root_tree = Path(after.env["VLLM_CACHE_ROOT"])
    assert not root_tree.exists() or root_tree.stat().st_uid == 0
    for variable in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
        home = Path(after.env[variable]).parent
        assert home.stat().st_uid == 0 and not home.stat().st_mode & 0o077, variable


@ROOT_ONLY
def test_roots_home_owned_by_another_account_refuses_the_start(tmp_path: Path) -> None:
    """An uid-0 made by someone else (or left by an old layout) is refused, never used nor silently taken."""
    (tmp_path / "uid-0").mkdir(mode=0o700)
    os.chown(tmp_path / "uid-0", NOBODY, NOBODY)
    with pytest.raises(CacheUntrusted) as info:
        prepare_spawn(spec(tmp_path), {"PATH": "/usr/bin:/bin"})
    assert info.value.exit_code == 78
    assert info.value.message == (
        f"paths.cache_directory: cache home {tmp_path}/uid-0 is owned by user 'nobody' (uid {NOBODY}), not user "
        f"'root' (uid 0); remove it (rm -r {tmp_path}/uid-0), it is made again at the next start"
    )


def test_a_home_writable_by_others_refuses_the_start(tmp_path: Path) -> None:
    home = tmp_path / f"uid-{os.geteuid()}"
    home.mkdir()
    home.chmod(0o777)
    with pytest.raises(CacheUntrusted, match="is writable by group or others \\(mode 0777\\)"):
        prepare_spawn(spec(tmp_path), {"PATH": "/usr/bin:/bin"})


def test_a_cache_directory_others_may_write_refuses_the_start(tmp_path: Path) -> None:
    """Whoever may write the cache directory may swap the home after the check: refused before anything."""
    tmp_path.chmod(0o1777)
    with pytest.raises(CacheUntrusted, match="is writable by group or others"):
        prepare_spawn(spec(tmp_path), {"PATH": "/usr/bin:/bin"})
    assert list(tmp_path.iterdir()) == []


@ROOT_ONLY
def test_a_home_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / f"uid-{NOBODY}").mkdir(mode=0o700)  # root's, not nobody's: the child could not write it
    with pytest.raises(CacheUntrusted, match="is owned by user 'root' \\(uid 0\\), not user 'nobody'"):
        prepare_spawn(spec(tmp_path, user="nobody"), {"PATH": "/usr/bin:/bin"})


def test_a_dry_run_creates_and_chowns_nothing(tmp_path: Path) -> None:
    """Was (docs/operators-view.md): `--dry-run` made and chowned <cache>/<child.user>; it must change nothing."""
    (tmp_path / "cache").mkdir()  # the unit's CacheDirectory=, as systemd makes it
    child: dict[str, object] = {"argv": ["/bin/true"]}
    if os.geteuid() == 0:
        child["user"] = "nobody"  # the old code made and chowned <cache>/nobody
    sections = fake_sections(tmp_path)
    config = write_config(tmp_path / "kimi.toml", {"child": child, **sections})
    before = _tree(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "run", "--dry-run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _tree(tmp_path) == before
    assert "a start would create it (0700)" in result.stdout


def test_the_dry_run_line_reports_size_writability_and_compile_caches(tmp_path: Path) -> None:
    missing = check_cache(tmp_path / "absent", None, {})
    assert missing.verdict is Verdict.WARN and "CacheDirectory=" in missing.message
    aot = tmp_path / f"uid-{os.geteuid()}" / "vllm" / "torch_compile_cache" / "torch_aot_compile" / "b514c290"
    aot.mkdir(parents=True)
    (aot / "model").write_bytes(b"x" * 2_000_000)
    ok = check_cache(tmp_path, None, {})
    assert ok.verdict is Verdict.OK and ok.data["compile_caches"] == 1 and ok.data["bytes"] == 2_000_000
    assert "holds 1 compile cache(s)" in ok.message and ok.data["writable"]


@ROOT_ONLY
def test_the_dry_run_says_when_the_childs_user_cannot_write(tmp_path: Path) -> None:
    (tmp_path / f"uid-{NOBODY}").mkdir(mode=0o755)  # root's: nobody cannot write it
    identity = resolve_identity("nobody", None)
    check = check_cache(tmp_path, identity, {})
    assert check.verdict is Verdict.WARN and "not writable by user 'nobody'" in check.message


@ROOT_ONLY
def test_a_symlink_planted_at_the_users_home_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (tmp_path / f"uid-{NOBODY}").symlink_to(victim)
    with pytest.raises(CacheUntrusted, match="is a symbolic link"):
        prepare_spawn(spec(tmp_path, user="nobody"), {"PATH": "/usr/bin:/bin"})
    assert victim.stat().st_uid == 0


def _user_named_vllm(monkeypatch: pytest.MonkeyPatch) -> str:
    """A child user named `vllm`, as the issue's: nobody's uid under that name (tests add no account to the host)."""
    real = process.resolve_identity

    def resolve(user: str | None, group: str | None) -> Identity | None:
        if user != "vllm":
            return real(user, group)
        return Identity("vllm", NOBODY, NOBODY, (NOBODY,), "/nonexistent")

    monkeypatch.setattr(process, "resolve_identity", resolve)
    return "vllm"


def _tree(root: Path) -> list[tuple[str, int, int, int, int]]:
    """Every entry under `root`: name, owner, group, mode and mtime (nanoseconds)."""
    out = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out.append((str(path.relative_to(root)), st.st_uid, st.st_gid, st.st_mode, st.st_mtime_ns))
    st = root.lstat()
    return [*out, (".", st.st_uid, st.st_gid, st.st_mode, st.st_mtime_ns)]
