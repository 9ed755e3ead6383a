"""Which build runs: the version comes from git through setuptools-scm (pyproject.toml), reaches `--version`, the
state file's supervisor.version and kimi_supervisor_build_info; a tree never built says it does not know."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import kimi_supervisor
from kimi_supervisor.opsview.textfile import MetricsSnapshot, render

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def test_the_version_is_what_setuptools_scm_wrote_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    written = types.ModuleType("kimi_supervisor._version")
    written.version = "0.1.1.dev438+g6243c5adc"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kimi_supervisor._version", written)
    assert kimi_supervisor._build_version() == "0.1.1.dev438+g6243c5adc"
    monkeypatch.setitem(sys.modules, "kimi_supervisor._version", None)  # a checkout run in place: no file
    assert kimi_supervisor._build_version() == kimi_supervisor.UNKNOWN_VERSION == "0+unknown"


def test_pyproject_derives_the_version_from_git_with_a_fallback_for_a_tarball() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert any(r.startswith("setuptools-scm") for r in project["build-system"]["requires"])
    assert "version" in project["project"]["dynamic"] and "dynamic" not in project["tool"]["setuptools"]
    scm = project["tool"]["setuptools_scm"]
    assert scm["version_file"] == "kimi_supervisor/_version.py" and scm["fallback_version"] == "0.1.0"
    # A bookmark tag (`pre34`) is not a version: only vX.Y.Z tags are asked for.
    assert scm["scm"]["git"]["describe_command"][-2:] == ["--match", "v[0-9]*"]
    assert "/kimi_supervisor/_version.py" in (REPO / ".gitignore").read_text().splitlines()


def test_version_reaches_the_command_line_and_the_textfile(capsys: pytest.CaptureFixture[str]) -> None:
    from kimi_supervisor.cli.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--version"])
    assert capsys.readouterr().out == f"kimi-supervisor {kimi_supervisor.__version__}\n"
    text = render(MetricsSnapshot(state="ready"), "kimi-a").decode()
    assert (
        f'kimi_supervisor_build_info{{deployment="kimi-a",role="engine",version="{kimi_supervisor.__version__}"}} 1.0'
        in (text)
    )
