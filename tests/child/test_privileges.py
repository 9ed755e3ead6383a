"""child.user and child.group: real privilege drop, and nothing done for a start that cannot happen."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kimi_supervisor.child.process import ChildProcess, SpawnSpec, prepare_spawn
from kimi_supervisor.child.spawnplan import Unresolvable, resolve_identity
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import ConfigError, ExitCode
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.lifecycle.deps import Deps
from kimi_supervisor.lifecycle.supervisor import Supervisor
from kimi_supervisor.logs.journal import ConsoleChildSink
from kimi_supervisor.states import State
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from testkit.harness import REPO, free_port, own_dirs, write_config
from tests.conftest import ProcSpawner, close_pipes

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="switching users needs root")
BOGUS = "no-such-user-kimi13"


def spec(*argv: str, **kw: object) -> SpawnSpec:
    base: dict[str, object] = {"env": {}, "inherit_environment": True, "working_directory": None, "user": None}
    base.update(kw)
    return SpawnSpec(argv=tuple(argv), **base)  # type: ignore[arg-type]


def output_of(child: ChildProcess, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    out = b""
    while time.monotonic() < deadline:
        data = child.read(child.streams["stdout"])
        if data is None:
            break
        out += data
        if not data:
            time.sleep(0.01)
    close_pipes(child)
    return out.decode()


@needs_root
def test_child_user_gets_the_users_groups_and_home_not_roots() -> None:
    # Before: uid nobody, but gid 0, root's supplementary groups and HOME=/root.
    env = {**os.environ, "HOME": "/root", "USER": "root", "LOGNAME": "root"}
    child = ChildProcess.spawn(
        spec("/bin/sh", "-c", 'id; echo "home=$HOME user=$USER logname=$LOGNAME"', user="nobody"), env
    )
    ids, names = output_of(child).splitlines()
    assert child._popen.wait(5) == 0
    nobody = pwd.getpwnam("nobody")
    assert ids.startswith(f"uid={nobody.pw_uid}(nobody) gid={nobody.pw_gid}(")
    groups = ids.split("groups=")[1]
    assert "0(" not in groups.split(",")[0] and all(not g.startswith("0(") for g in groups.split(","))
    assert names == f"home={nobody.pw_dir} user=nobody logname=nobody"


@needs_root
def test_child_group_sets_the_primary_group_and_child_env_wins_for_home(tmp_path: Path) -> None:
    child = ChildProcess.spawn(
        spec("/bin/sh", "-c", 'id -g; id -G; echo "$HOME"', user="nobody", group="users", env={"HOME": str(tmp_path)})
    )
    gid, groups, home = output_of(child).splitlines()
    assert gid == "100"
    assert "0" not in groups.split() and "100" in groups.split()
    assert home == str(tmp_path)


@needs_root
def test_child_as_a_numeric_uid() -> None:
    identity = resolve_identity("65534", None)
    assert identity is not None and identity.user == "nobody" and 0 not in identity.groups


def test_unknown_user_group_and_executable_are_named() -> None:
    with pytest.raises(Unresolvable) as info:
        prepare_spawn(spec("/bin/true", user=BOGUS), {})
    assert (info.value.key, info.value.message) == ("user", f"no such user {BOGUS!r} on this host")
    with pytest.raises(Unresolvable) as info:
        prepare_spawn(spec("/bin/true", user="nobody", group="no-such-group-kimi13"), {})
    assert (info.value.key, info.value.message) == ("group", "no such group 'no-such-group-kimi13' on this host")
    # Looked up on the PATH the child will get, not the supervisor's.
    assert prepare_spawn(spec("true"), {"PATH": "/usr/bin:/bin"}).executable in ("/usr/bin/true", "/bin/true")
    with pytest.raises(Unresolvable) as info:
        prepare_spawn(spec("true", env={"PATH": "/nonexistent"}), {"PATH": "/usr/bin:/bin"})
    assert (info.value.key, info.value.message) == ("argv[0]", "'true' not found on the child's PATH (/nonexistent)")


@needs_root
def test_executable_that_only_root_may_run_is_refused_for_nobody(open_dir: Path) -> None:
    tool = open_dir / "serve"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o700)
    assert prepare_spawn(spec(str(tool)), {}).executable == str(tool)
    with pytest.raises(Unresolvable) as info:
        prepare_spawn(spec(str(tool), user="nobody"), {})
    assert info.value.message == f"{tool} is not an executable file for user 'nobody'"


@needs_root
def test_executable_in_a_directory_the_child_may_not_search_is_refused(open_dir: Path) -> None:
    # Before: the file's own mode was all that was looked at; execve as nobody then failed EACCES (exit 15).
    nobody = pwd.getpwnam("nobody")
    locked = open_dir / "opt" / "venv"
    locked.mkdir(parents=True)
    tool = locked / "python3"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    for mode, group, searchable in (
        (0o700, 0, False),
        (0o711, 0, True),  # others' x
        (0o710, nobody.pw_gid, True),  # through nobody's own group
        (0o701, nobody.pw_gid, False),  # in the group, whose class has no x: others' x does not apply
    ):
        os.chown(locked, 0, group)
        locked.chmod(mode)
        assert prepare_spawn(spec(str(tool)), {}).executable == str(tool)  # root searches any directory
        if searchable:
            assert prepare_spawn(spec(str(tool), user="nobody"), {}).executable == str(tool)
            continue
        with pytest.raises(Unresolvable) as info:
            prepare_spawn(spec(str(tool), user="nobody"), {})
        assert (info.value.key, info.value.message) == (
            "argv[0]",
            f"{tool} is in {locked}, a directory user 'nobody' may not search (no x permission)",
        ), oct(mode)
    # Through a symlink: the target's directories are the ones execve walks.
    locked.chmod(0o700)
    link = open_dir / "python3"
    link.symlink_to(tool)
    with pytest.raises(Unresolvable) as info:
        prepare_spawn(spec("python3", user="nobody", env={"PATH": str(open_dir)}), {})
    assert info.value.message == f"{link} is in {locked}, a directory user 'nobody' may not search (no x permission)"


@needs_root
def test_cli_interpreter_under_a_0700_directory_exits_78_naming_it_and_acts_on_nothing(
    tmp_path: Path, open_dir: Path
) -> None:
    # Before: argv[0] passed, the preflight removed the stale shm file, then the spawn failed: exit 15, restarted.
    locked = open_dir / "venv"
    locked.mkdir(mode=0o700)
    tool = locked / "vllm"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    cfg, shm, run = cli_start(tmp_path, {"argv": [str(tool), "serve"], "user": "nobody"})
    assert run.returncode == 78, run.stderr[-2000:]
    assert (shm / "psm_stale").exists()
    words = f"{cfg}: child.argv[0]: {tool} is in {locked}, a directory user 'nobody' may not search (no x permission)"
    assert words in run.stderr


@pytest.mark.parametrize(
    ("child", "message"),
    [
        ({"user": BOGUS}, f"child.user: no such user {BOGUS!r} on this host"),
        ({"env": {"PATH": "/nonexistent"}}, "child.argv[0]: 'vllm' not found on the child's PATH (/nonexistent)"),
    ],
)
def test_a_start_that_cannot_happen_kills_nothing_and_removes_nothing(
    tmp_path: Path, spawner: ProcSpawner, child: dict[str, object], message: str
) -> None:
    # Before: the preflight killed the stale server and removed its files, then the spawn failed (exit 15).
    stale = spawner.sleeper(title="VLLM::Worker_TP0", extra_args=["-m", "vllm.entrypoints.openai.api_server"])
    shm = tmp_path / "shm"
    shm.mkdir()
    stale_file = shm / "psm_stale"
    stale_file.write_bytes(b"x")
    cfg = parse_config(
        {
            "child": {"argv": ["vllm", "serve", "/m", "--port", str(free_port())], **child},
            "preflight": {"gpus": [0], "check_model": False, "reap": {"grace_s": 1}, "shm": {"directory": str(shm)}},
            "paths": own_dirs(tmp_path),
        },
        tmp_path / "k.toml",
    )
    log = RecordingLog()
    sup = Supervisor(
        cfg,
        Deps(
            probe=FakeGpuProbe([FakeGpu(occupants={stale.pid: 40_000})]),
            table=PsutilProcessTable(),
            notifier=type("N", (), {"send": lambda self, **f: None})(),
            log=log,
            sink=ConsoleChildSink(open(os.devnull, "w")),  # noqa: SIM115
        ),
    )
    with pytest.raises(ConfigError) as info:
        sup.run()
    assert info.value.message == f"{tmp_path / 'k.toml'}: {message}"
    assert info.value.exit_code == ExitCode.CONFIG
    assert sup.state.history == [State.PREFLIGHT, State.FAILED]
    assert psutil.Process(stale.pid).status() != psutil.STATUS_ZOMBIE
    assert stale_file.exists()
    assert sup.child is None


def cli_start(tmp_path: Path, child: dict[str, object]) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """The real CLI started on a config with CHILD and a stale shm file the preflight would remove."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "psm_stale").write_bytes(b"x")
    cfg = write_config(
        tmp_path / "k.toml",
        {
            "child": child,
            "preflight": {"gpus": [], "check_model": False, "check_port": False},
            "preflight.shm": {"directory": str(shm)},
        },
    )
    run = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(cfg), "--log-format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    return cfg, shm, run


def test_cli_bogus_user_exits_78_in_one_line_and_the_dry_run_says_why(tmp_path: Path) -> None:
    cfg, shm, run = cli_start(tmp_path, {"argv": [sys.executable, "-c", "pass"], "user": BOGUS})
    assert run.returncode == 78
    assert (shm / "psm_stale").exists()
    assert f"{cfg}: child.user: no such user {BOGUS!r} on this host" in run.stderr
    dry = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--dry-run", "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert dry.returncode == 10
    assert f"[      FAILED] child               child.user: no such user {BOGUS!r} on this host" in dry.stdout
