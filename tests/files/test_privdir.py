"""A directory root makes for one account: made through descriptors that follow no link, refused when not its own."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.files.privdir import Refused, private_dir
from testkit.harness import REPO

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
NOBODY = pwd.getpwnam("nobody").pw_uid


@ROOT_ONLY
def test_made_0700_for_the_account_and_used_again(tmp_path: Path) -> None:
    old = os.umask(0o077)  # the umask must not decide the mode
    try:
        first = private_dir(tmp_path, "d", NOBODY, NOBODY)
    finally:
        os.umask(old)
    st = (tmp_path / "d").lstat()
    assert first.made and st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o700
    again = private_dir(tmp_path, "d", NOBODY, NOBODY)
    assert again.exists and not again.made


@ROOT_ONLY
def test_another_accounts_directory_is_refused_never_taken(tmp_path: Path) -> None:
    """A deployment moved from root to `user = "vllm"` leaves root's directory: refused, not chowned."""
    (tmp_path / "d").mkdir(mode=0o700)
    with pytest.raises(Refused, match=f"is owned by user 'root' \\(uid 0\\), not user 'nobody' \\(uid {NOBODY}\\)"):
        private_dir(tmp_path, "d", NOBODY, NOBODY)
    assert (tmp_path / "d").stat().st_uid == 0


def test_a_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    (tmp_path / "d").symlink_to(target)
    with pytest.raises(Refused, match="is a symbolic link"):
        private_dir(tmp_path, "d", os.geteuid(), os.getegid())
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_a_group_writable_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d").chmod(0o770)
    with pytest.raises(Refused, match="writable by group or others \\(mode 0770\\)"):
        private_dir(tmp_path, "d", os.geteuid(), os.getegid())


def test_without_create_nothing_is_made(tmp_path: Path) -> None:
    found = private_dir(tmp_path, "d", os.geteuid(), os.getegid(), create=False)
    assert not found.exists and not found.made and list(tmp_path.iterdir()) == []


@ROOT_ONLY
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) drops a capability")
def test_a_handover_refused_leaves_no_directory_behind(tmp_path: Path) -> None:
    """Root without CAP_CHOWN (a unit whose CapabilityBoundingSet= lacks it) cannot hand the directory over: the
    error is raised and the directory it made is gone, so the next start tries again instead of refusing a
    directory of root's (was: exit 78 "is owned by user 'root'" on every start after the first)."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kimi_supervisor.files.privdir import private_dir\n"
        "try:\n"
        f"    private_dir(Path(sys.argv[1]), 'd', {NOBODY}, {NOBODY})\n"
        "except PermissionError as e:\n"
        "    print('refused', e.strerror)\n"
    )
    done = subprocess.run(
        ["setpriv", "--bounding-set", "-chown", "--inh-caps", "-chown", "--", sys.executable, "-c", script, tmp_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    assert done.stdout.strip() == "refused Operation not permitted", done.stderr
    assert not (tmp_path / "d").exists()


@ROOT_ONLY
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) drops a capability")
def test_root_without_dac_capabilities_accepts_the_accounts_own_private_directory(tmp_path: Path) -> None:
    """The front's unit has no CAP_DAC_OVERRIDE or CAP_DAC_READ_SEARCH: its root start checks the socket directory
    that the engine made 0700 for the child's account (the engine started first).  It is that account's and
    private: accepted (was: refused as "not a directory", exit 78, since root could not open it)."""
    (tmp_path / "d").mkdir(mode=0o700)
    os.chown(tmp_path / "d", NOBODY, NOBODY)
    tmp_path.chmod(0o755)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kimi_supervisor.files.privdir import private_dir\n"
        f"found = private_dir(Path(sys.argv[1]), 'd', {NOBODY}, {NOBODY})\n"
        "print(found.exists, found.made)\n"
    )
    drop = "-dac_override,-dac_read_search"
    done = subprocess.run(
        ["setpriv", "--bounding-set", drop, "--inh-caps", drop, "--", sys.executable, "-c", script, tmp_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True False"), done.stderr[-2000:]
