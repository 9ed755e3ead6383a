"""The unit file: packaging/ is the rendered template; systemd-analyze verify accepts it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor import unit

REPO = Path(__file__).resolve().parent.parent
PACKAGED = REPO / "packaging" / "systemd" / "kimi-supervisor.service"


def test_packaged_unit_is_the_rendered_template() -> None:
    assert PACKAGED.read_text() == unit.render()


def directives(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = " ".join(value.split())
    return out


def test_unit_directives() -> None:
    d = directives(unit.render())
    assert d["Type"] == "notify" and d["NotifyAccess"] == "main" and d["KillMode"] == "mixed"
    assert d["Restart"] == "on-failure" and d["RestartPreventExitStatus"] == "78"
    assert d["ExecStart"] == "/usr/local/bin/kimi-supervisor --config /etc/kimi-supervisor/kimi-supervisor.toml"
    # Stop must outlast grace (30) + SIGKILL wait (5) + GPU release wait (30).
    assert int(d["TimeoutStopSec"]) > 30 + 8 + 5 + 30
    assert d["LimitMEMLOCK"] == "infinity"
    assert "CAP_KILL" in d["CapabilityBoundingSet"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    path = tmp_path / unit.UNIT_NAME
    path.write_text(unit.render(sys.executable, tmp_path / "k.toml"))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""


def test_install_writes_the_unit(tmp_path: Path) -> None:
    target = unit.install(Path("/etc/kimi-supervisor/kimi-supervisor.toml"), tmp_path, reload=False)
    text = target.read_text()
    assert target == tmp_path / "kimi-supervisor.service"
    assert "--config /etc/kimi-supervisor/kimi-supervisor.toml" in text
    assert (target.stat().st_mode & 0o777) == 0o644


def test_paths_that_systemd_would_mangle_are_quoted() -> None:
    # Before: refused with exit 70 ("a bug"); systemd's own quoting rules express any path.
    d = directives(unit.render(["/opt/my tools/kimi-supervisor"], Path("/etc/k 50%/$x.toml")))
    assert d["ExecStart"] == '"/opt/my tools/kimi-supervisor" --config "/etc/k 50%%/$$x.toml"'
