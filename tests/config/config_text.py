"""Config tests' two steps: load a config from its text, or get the one-line error that refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ConfigError, ExitCode


def load(tmp_path: Path, text: str, name: str = "k.toml"):  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(text)
    return load_config(path)


def error_of(tmp_path: Path, text: str, name: str = "k.toml") -> str:
    """The refusal: a config error (exit 78) on one line, the file's path written `{p}`."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, name)
    assert info.value.exit_code == ExitCode.CONFIG and "\n" not in info.value.message
    return info.value.message.replace(str(tmp_path / name), "{p}")
