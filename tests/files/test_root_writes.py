"""Files written as root never follow links and never trust a directory they don't own (docs/hardening.md).

state.json, history.json and the metrics textfile used to be written through `.<name>.<pid>.tmp`, opened
without O_EXCL/O_NOFOLLOW, in directories nobody checked: whoever could write the directory planted a
symlink there and root truncated, filled and chmodded 0644 any file.  These tests run as root (as the
supervisor does) with victims and directories of their own under tmp_path; `nobody` plays the other account.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config, parse_config
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.files import atomic as atomicfile
from kimi_supervisor.files import dirtrust
from kimi_supervisor.files.atomic import UnsafeDirectory, write_atomic
from kimi_supervisor.opsview.statefile import StateFile
from testkit.fakes.log import RecordingLog
from testkit.harness import REPO, fake_config

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attack is on root's writes")


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text("root's secret\n")
    path.chmod(0o600)
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == "root's secret\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_link_planted_at_the_temporary_name_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = victim(tmp_path)
    directory = tmp_path / "run"
    directory.mkdir()
    # The name the old code used (predictable: the writer's PID), and the first name the new code draws.
    (directory / f".state.json.{os.getpid()}.tmp").symlink_to(target)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(atomicfile.secrets, "token_hex", lambda n: next(names))
    (directory / ".state.json.planted.tmp").symlink_to(target)
    write_atomic(directory / "state.json", b'{"new": 1}\n')
    assert_untouched(target)
    assert (directory / "state.json").read_bytes() == b'{"new": 1}\n'
    assert stat.S_IMODE((directory / "state.json").stat().st_mode) == 0o644
    assert not (directory / "state.json").is_symlink()
    assert (directory / ".state.json.planted.tmp").is_symlink()  # skipped, not opened, not removed


def test_the_temporary_name_is_unpredictable() -> None:
    drawn = set()
    for _ in range(3):
        drawn.add(atomicfile.secrets.token_hex(8))
    assert len(drawn) == 3 and not any(str(os.getpid()) == d for d in drawn)


def test_a_link_planted_at_the_final_name_is_replaced_not_followed(tmp_path: Path) -> None:
    target = victim(tmp_path)
    directory = tmp_path / "state"
    directory.mkdir()
    (directory / "history.json").symlink_to(target)
    write_atomic(directory / "history.json", b"{}\n")
    assert_untouched(target)
    assert not (directory / "history.json").is_symlink() and (directory / "history.json").read_bytes() == b"{}\n"


def test_a_directory_loosened_after_the_start_is_refused_at_the_write(tmp_path: Path) -> None:
    target = victim(tmp_path)
    directory = tmp_path / "run"
    directory.mkdir()
    log = RecordingLog()
    sf = StateFile(directory, log)
    assert sf.write({"schema": 1})
    directory.chmod(0o777)  # e.g. an operator's chmod -R; an attacker can now plant names
    (directory / "state.json").unlink()
    (directory / "state.json").symlink_to(target)
    assert not sf.write({"schema": 1, "phase": "ready"})
    assert_untouched(target)
    [warning] = log.events("state_file.unwritable")
    assert "writable by group or others (mode 0777)" in str(warning["error"])
    with pytest.raises(UnsafeDirectory):
        write_atomic(directory / "x.json", b"")
    os.chown(directory, NOBODY, NOBODY)
    directory.chmod(0o755)
    with pytest.raises(UnsafeDirectory, match="owned by uid 65534, not root"):
        write_atomic(directory / "x.json", b"")


def _cfg(tmp_path: Path, **paths: str) -> object:
    # A directory a test does not name is its own too: prepare_directories creates what is missing, and the
    # defaults are the host's /run/kimi-supervisor and /var/lib/kimi-supervisor.
    own = {"runtime_directory": str(tmp_path / "own-run"), "state_directory": str(tmp_path / "own-state")}
    chosen = {k: v for k, v in paths.items() if k != "textfile"}
    raw: dict[str, object] = {"child": {"argv": ["vllm"]}, "paths": {**own, **chosen}}
    if "textfile" in paths:
        raw["metrics"] = {"textfile": paths["textfile"]}
    return parse_config(raw, tmp_path / "k.toml")


def test_a_world_writable_directory_like_the_old_demo_one_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"  # /tmp: sticky and world-writable, fine *above* our directory
    shared.mkdir()
    shared.chmod(0o1777)
    ok = _cfg(tmp_path, runtime_directory=str(shared / "ours" / "run"), state_directory=str(shared / "ours" / "s"))
    dirtrust.prepare_directories(ok)  # type: ignore[arg-type]
    assert stat.S_IMODE((shared / "ours" / "run").stat().st_mode) == 0o755
    # Another account made the directory first (as nobody could with /tmp/kimi-demo): refused, one line.
    squat = shared / "kimi-demo"
    squat.mkdir(mode=0o777)
    squat.chmod(0o777)
    os.chown(squat, NOBODY, NOBODY)
    bad = _cfg(tmp_path, runtime_directory=str(squat / "run"), state_directory=str(shared / "ours" / "s"))
    with pytest.raises(ConfigError) as raised:
        dirtrust.prepare_directories(bad)  # type: ignore[arg-type]
    message = raised.value.message
    assert "paths.runtime_directory" in message and f"directory {squat} is owned by uid 65534" in message
    assert "\n" not in message and not (squat / "run").exists()  # nothing created in it
    # The directory holding our files may not be world-writable even when sticky.
    with pytest.raises(ConfigError, match=r"paths.state_directory: directory .* writable by group or others"):
        dirtrust.check_directory(shared, "paths.state_directory", tmp_path / "k.toml")


def test_a_symlink_in_a_directory_another_account_owns_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    good = tmp_path / "good"
    good.mkdir()
    (theirs / "state").symlink_to(good)  # it resolves to a fine directory, but nobody chooses where
    with pytest.raises(ConfigError, match=r"paths.state_directory: directory .*theirs is owned by uid 65534"):
        dirtrust.prepare_directories(_cfg(tmp_path, state_directory=str(theirs / "state")))  # type: ignore[arg-type]
    # And a root-owned link into a directory nobody owns: the resolved path is checked too.
    (tmp_path / "link").symlink_to(theirs)
    with pytest.raises(ConfigError, match=r"\(from .*link\) is owned by uid 65534"):
        dirtrust.check_directory(tmp_path / "link", "paths.state_directory", tmp_path / "k.toml")


def test_the_metrics_directory_is_checked_and_named(tmp_path: Path) -> None:
    exporter = tmp_path / "textfile_collector"
    exporter.mkdir()
    os.chown(exporter, NOBODY, NOBODY)  # the exporter's account owns it: it could plant links for root
    cfg = _cfg(
        tmp_path,
        runtime_directory=str(tmp_path / "run"),
        state_directory=str(tmp_path / "state"),
        textfile=str(exporter / "kimi.prom"),
    )
    with pytest.raises(ConfigError, match=r"metrics.textfile: directory .*textfile_collector is owned by uid 65534"):
        dirtrust.prepare_directories(cfg)  # type: ignore[arg-type]


def test_a_run_refuses_an_unsafe_state_directory_with_exit_78_in_one_line(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    target = victim(tmp_path)
    (loose / "kimi").mkdir()
    (loose / "kimi" / "history.json").symlink_to(target)
    cfg = fake_config(tmp_path, paths={"state_directory": str(loose)})
    done = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(cfg), "--log-format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 78, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "paths.state_directory" in done.stderr
    assert "writable by group or others (mode 0777)" in done.stderr
    assert_untouched(target)
    assert not (tmp_path / "run" / "kimi" / "state.json").exists()  # refused before anything was written
    dry = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--dry-run", "--json", "--config", str(cfg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    report = json.loads(dry.stdout)
    assert dry.returncode == 10 and report["checks"][0]["name"] == "paths"
    assert "paths.state_directory" in report["checks"][0]["message"]


def test_the_demo_profile_writes_under_the_checkout_not_tmp() -> None:
    cfg = load_config(REPO / "etc" / "kimi-supervisor.demo.toml")
    for directory in (cfg.paths.runtime_directory, cfg.paths.state_directory):
        assert directory.is_relative_to(REPO / ".demo-state"), directory
        dirtrust.check_directory(directory, "paths.x", cfg.path)  # the checkout's directories are safe here
