"""The config file as a hostile local user would hand it over: FIFOs, devices, symlinks, huge, deep, writable."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.config.file import MAX_BYTES
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ConfigError
from testkit.harness import REPO

ROOT = os.geteuid() == 0
NOBODY = 65534
MINIMAL = '[child]\nargv = ["vllm", "serve", "/m"]\n'
needs_root = pytest.mark.skipif(not ROOT, reason="ownership checks apply when running as root")


# What one `check-config` may take: a hang's bound (an interpreter's start beside a second suite took over 10 s),
# and an address space that stops a reader of an endless file (/dev/zero) at once, whatever the machine's speed,
# before it can grow towards the OOM killer.
HANG_S = 120
MEMORY_BYTES = 1 << 30


def _bounded_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=HANG_S,
        preexec_fn=_bounded_memory,
    )


def refusal(path: Path) -> str:
    """Why load_config refuses PATH (it must)."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.message


def owned_by_nobody(what: str, path: Path) -> str:
    return f"{what} {path} is owned by uid 65534, not root; refusing it while running as root (chown root {path})"


def one_line_78(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 78, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.removeprefix("kimi-supervisor: config error: ").rstrip("\n")


def test_fifo_owned_by_nobody_is_refused_without_blocking(tmp_path: Path) -> None:
    # Before: the FIFO was opened blocking and read; whoever wrote to it chose the argv root runs.
    fifo = tmp_path / "k.toml"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    if ROOT:
        os.chown(fifo, NOBODY, NOBODY)
    # No writer ever opens it: a blocking open would hang here until HANG_S (TimeoutExpired fails the test).
    message = one_line_78(check_config(fifo))
    assert message == f"{fifo}: is a FIFO, expected a regular TOML file"


def test_fifo_behind_a_symlink_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "k.toml"
    link.symlink_to(fifo)
    assert refusal(link) == f"{link}: is a FIFO (resolves to {fifo}), expected a regular TOML file"


def test_symlink_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    # Before: read_bytes() on /dev/zero grew the RSS at ~0.9 GB/s until the OOM killer came.
    link = tmp_path / "k.toml"
    link.symlink_to("/dev/zero")
    message = one_line_78(check_config(link))
    assert message == f"{link}: is a character device (resolves to /dev/zero), expected a regular TOML file"


def test_size_cap(tmp_path: Path) -> None:
    at_cap = tmp_path / "ok.toml"
    body = MINIMAL.encode()
    at_cap.write_bytes(body + b"#" * (MAX_BYTES - len(body) - 1) + b"\n")
    assert at_cap.stat().st_size == MAX_BYTES == 1 << 20
    assert load_config(at_cap).child.argv == ("vllm", "serve", "/m")
    over = tmp_path / "big.toml"
    over.write_bytes(body + b"#" * MAX_BYTES + b"\n")
    assert refusal(over) == f"{over}: {over.stat().st_size} bytes, larger than the 1048576-byte limit for a config"


def test_a_file_that_reports_size_zero_is_read_only_up_to_the_cap(tmp_path: Path) -> None:
    # /proc files report size 0 and can produce any amount: the reader stops at the cap all the same.
    from kimi_supervisor.config.file import read_config_bytes

    data = read_config_bytes(Path("/proc/self/maps"), max_bytes=1 << 20)
    assert 0 < len(data) <= 1 << 20
    with pytest.raises(ConfigError, match=r"larger than the 64-byte limit for a config"):
        read_config_bytes(Path("/proc/self/maps"), max_bytes=64)


@pytest.mark.parametrize("opener", ["[", "{a="])
def test_deep_nesting_is_a_config_error_not_a_crash(tmp_path: Path, opener: str) -> None:
    # Before: a 100k-deep array gave a RecursionError traceback and exit 70.
    path = tmp_path / "k.toml"
    path.write_text(MINIMAL + "x = " + opener * 100_000 + "\n")
    message = one_line_78(check_config(path))
    assert message == f"{path}: invalid TOML: arrays or tables nested too deeply"


def test_integer_too_long_for_python_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text(MINIMAL + "[health]\nfailures_tolerated = " + "9" * 5000 + "\n")
    message = one_line_78(check_config(path))
    assert message.startswith(f"{path}: invalid TOML: ")


@needs_root
def test_symlink_target_owned_by_nobody_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "real.toml"
    target.write_text(MINIMAL)
    os.chown(target, NOBODY, NOBODY)
    link = tmp_path / "k.toml"
    link.symlink_to(target)
    assert refusal(link) == f"{link}: {owned_by_nobody('its target', target)}"


@needs_root
def test_root_owned_file_in_a_directory_nobody_can_write_is_refused(tmp_path: Path) -> None:
    # nobody could rename a file of theirs over it between two starts.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)
    cfg = shared / "k.toml"
    cfg.write_text(MINIMAL)
    assert refusal(cfg) == f"{cfg}: {owned_by_nobody('directory', shared)}"
    os.chown(shared, 0, 0)
    shared.chmod(0o775)
    with pytest.raises(ConfigError, match=re.escape(f"directory {shared} is writable by group or others (mode 0775)")):
        load_config(cfg)
    shared.chmod(0o755)
    assert load_config(cfg).child.argv[0] == "vllm"


@needs_root
def test_safe_target_reached_through_a_symlink_in_a_sticky_directory_is_accepted(tmp_path: Path) -> None:
    # Like a config under /tmp: the sticky bit stops others renaming root's entries there.
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    cfg = sticky / "k.toml"
    cfg.write_text(MINIMAL)
    cfg.chmod(0o644)
    assert load_config(cfg).child.argv[0] == "vllm"
    sticky.chmod(0o0777)  # the same directory without the sticky bit is refused
    with pytest.raises(ConfigError, match="is writable by group or others"):
        load_config(cfg)


def test_symlink_loop_and_dangling_link(tmp_path: Path) -> None:
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    assert refusal(loop) == f"{loop}: cannot resolve config path: Too many levels of symbolic links"
    dangling = tmp_path / "dangling.toml"
    dangling.symlink_to(tmp_path / "absent")
    assert refusal(dangling) == f"{dangling}: config file not found (use --config PATH)"
