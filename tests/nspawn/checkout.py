"""Run THIS checkout's kimi-supervisor inside an nspawn container, wherever the checkout lives.

Two things would otherwise make the real-systemd tiers test something else than the code under test:

* The `kimi-supervisor` first on PATH belongs to whatever was pip-installed last (an editable install
  of another checkout, say). So units run a launcher that puts this checkout first on ``sys.path``
  and starts ``python -m kimi_supervisor`` with the interpreter running the tests.
* A checkout under /tmp or /var/tmp (a normal place to clone a project) is hidden twice: by the
  container's own /tmp (the harness binds the checkout at the same path to fix that) and by the
  unit's ``PrivateTmp=yes``. A drop-in with ``BindReadOnlyPaths=`` brings it back into the unit's
  namespace; systemd resolves the source before the private /tmp covers it.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# The e2e tier imports this as tests.nspawn.checkout, without this directory's conftest.
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from nspawn import NspawnMachine, needs_bind  # noqa: E402

REPO_ROOT = _HERE.parents[1]

#: Inside the container only (written into the overlay's upper layer, never on the host): the test
#: interpreter with this checkout first on sys.path, and kimi-supervisor run by it.
PYTHON = "/usr/local/libexec/kimi-checkout-python"
LAUNCHER = "/usr/local/libexec/kimi-supervisor-checkout"
DROPIN_NAME = "checkout.conf"


def binds_ro() -> list[str]:
    """The checkout (always: a live, consistent view) plus the interpreter's prefixes when they
    would be invisible inside the container (a venv under /tmp, on another mount)."""
    binds = [str(REPO_ROOT)]
    for prefix in (sys.prefix, sys.base_prefix):
        real = os.path.realpath(prefix)
        if needs_bind(real) and real not in binds:
            binds.append(real)
    return binds


def python_script() -> str:
    # PYTHONPATH wins over an editable install's finder, which sits after PathFinder in
    # sys.meta_path. The bind is read-only: no point trying to write __pycache__.
    return (
        "#!/bin/sh\n"
        f"exec /usr/bin/env PYTHONPATH={shlex.quote(str(REPO_ROOT))} PYTHONDONTWRITEBYTECODE=1 "
        f'{shlex.quote(sys.executable)} "$@"\n'
    )


def dropin_text(extra_binds: Iterable[str] = ()) -> str:
    paths = [*binds_ro(), *extra_binds]
    return "[Service]\n" + "".join(f"BindReadOnlyPaths={p}\n" for p in paths)


def install(m: NspawnMachine, unit_name: str, extra_binds: Iterable[str] = ()) -> str:
    """Write the launcher and the unit's bind drop-in (no daemon-reload); returns the launcher,
    the executable to render the unit with."""
    m.write_file(PYTHON, python_script(), mode=0o755)
    m.write_file(LAUNCHER, f'#!/bin/sh\nexec {PYTHON} -m kimi_supervisor "$@"\n', mode=0o755)
    m.write_file(f"/etc/systemd/system/{unit_name}.d/{DROPIN_NAME}", dropin_text(extra_binds))
    return LAUNCHER
