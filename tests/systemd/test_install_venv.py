"""The README's install: a virtualenv of its own (PEP 668 hosts refuse the system's pip), then that venv's
`kimi-supervisor install-unit`.  The unit runs the venv's executable and its Documentation= names a file the
install put there.  Built offline: the checkout's tracked files, pip without an index or build isolation (the
build backend's requirements are in the dev extra), the runtime dependencies seen through
--system-site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from kimi_supervisor.systemd import unit
from testkit.harness import REPO


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)


def test_install_unit_from_a_venv_runs_that_venv_and_names_its_installed_readme(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    for name in files.stdout.decode().split("\0"):
        if name and (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    venv = tmp_path / "venv"
    # The checkout under test must not shadow the venv's own copy.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], env)
    assert made.returncode == 0, made.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation"]
    installed = _run([*pip, "--no-deps", str(src)], env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    config = tmp_path / "kimi.toml"
    config.write_text('[child]\nargv = ["vllm", "serve", "/models/kimi"]\n')
    units = tmp_path / "units"
    exe = venv / "bin" / "kimi-supervisor"
    wrote = _run([str(exe), "install-unit", "--config", str(config), "--unit-dir", str(units), "--no-reload"], env)
    assert wrote.returncode == 0, wrote.stderr
    text = (units / unit.UNIT_NAME).read_text()
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["ExecStart"] == f"{exe} --config {config}"
    doc = Path(unquote(urlparse(lines["Documentation"]).path))
    assert lines["Documentation"].startswith("file:///")
    assert doc == venv / "share" / "doc" / "kimi-supervisor" / "README.md" and doc.is_file()
    # README's links and the alert rules' runbook_url resolve beside it.
    assert (doc.parent / "docs" / "operators-view.md").is_file()
    # The README's `ln -s` onto PATH: the unit still runs the venv's script, never the link.
    link = tmp_path / "bin" / "kimi-supervisor"
    link.parent.mkdir()
    link.symlink_to(exe)
    again = _run([str(link), "install-unit", "--config", str(config), "--unit-dir", str(units), "--no-reload"], env)
    assert again.returncode == 0, again.stderr
    assert f"\nExecStart={exe} --config {config}\n" in (units / unit.UNIT_NAME).read_text()
