"""Fixtures for the systemd (nspawn) test tier.

``machine``: one booted NspawnMachine per test module, with the repository
checkout bound read-only at its host path (plus the test interpreter's prefix
when it is not visible through the overlay of /, e.g. a venv under /tmp).
``m``: that machine with the kimi-supervisor unit installed (unit_setup.py).

If nspawn cannot run here the tests FAIL when ``CI`` is set (true/1/yes), so a
broken CI image cannot silently skip this tier; elsewhere they are skipped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Make `import nspawn` work whatever pytest's import mode / rootdir is.
_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from checkout import REPO_ROOT, binds_ro  # noqa: E402
from nspawn import NspawnMachine, available  # noqa: E402
from unit_setup import install  # noqa: E402

__all__ = ["REPO_ROOT", "default_binds_ro"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/nspawn/ carries the `systemd` marker, so
    `pytest -m "not systemd"` deselects this tier."""
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.systemd)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def default_binds_ro() -> list[str]:
    return binds_ro()


def require_nspawn() -> None:
    ok, reason = available()
    if ok:
        return
    msg = f"systemd-nspawn tier unavailable: {reason}"
    if _in_ci():
        pytest.fail(msg + " (CI is set, so this is an error; run .ci/install-systemd-tier.sh)")
    pytest.skip(msg)


@pytest.fixture
def nspawn_required() -> None:
    """For tests that build their own NspawnMachine: fail/skip like `machine`."""
    require_nspawn()


@pytest.fixture(scope="module")
def machine() -> Iterator[NspawnMachine]:
    require_nspawn()
    with NspawnMachine(binds_ro=default_binds_ro()) as m:
        yield m


@pytest.fixture(scope="module")
def m(machine: NspawnMachine) -> Iterator[NspawnMachine]:
    """The module's machine with the shipped unit running this checkout (unit_setup.install)."""
    install(machine)
    yield machine


@pytest.fixture
def machine_factory() -> Iterator[Callable[..., NspawnMachine]]:
    """Boot extra, per-test machines: ``m = machine_factory(binds_rw=[...])``.
    Keyword arguments go to NspawnMachine; ``binds_ro`` defaults to
    default_binds_ro().  All machines are torn down after the test."""
    require_nspawn()
    started: list[NspawnMachine] = []

    def make(**kwargs: Any) -> NspawnMachine:
        kwargs.setdefault("binds_ro", default_binds_ro())
        m = NspawnMachine(**kwargs)
        m.__enter__()
        started.append(m)
        return m

    try:
        yield make
    finally:
        errors: list[BaseException] = []
        for m in reversed(started):
            try:
                m.close()
            except BaseException as e:  # keep tearing down the others
                errors.append(e)
        if errors:
            raise errors[0]
