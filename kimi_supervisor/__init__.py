"""kimi-supervisor: run `vllm serve` as a well-behaved systemd Type=notify service."""

import importlib

# What a build whose version nobody derived says (pyproject's [tool.setuptools_scm] fallback_version too): a
# checkout run in place, never installed, has no version file.
UNKNOWN_VERSION = "0+unknown"


def _build_version() -> str:
    """The version setuptools-scm derived from git when this tree was built or installed (`pip install -e`
    writes it too): the module `_version` beside this one, which git ignores (pyproject.toml's version_file)."""
    try:
        # By name: the file exists only after a build, and mypy must pass on a clean checkout as well.
        written = importlib.import_module("kimi_supervisor._version")
    except ImportError:
        return UNKNOWN_VERSION
    return str(getattr(written, "version", UNKNOWN_VERSION))


__version__ = _build_version()
