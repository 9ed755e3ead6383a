"""The shipped unit inside a container, running this checkout: install it, deploy a config and a drop-in
with short timers, read it back. Shared by the kimi-supervisor tests of this tier and bench row 8.

The unit is the packaged one (kimi_supervisor.systemd.unit.render) with ExecStart pointing at a launcher that runs
this checkout's code (checkout.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import checkout
from nspawn import NspawnMachine

from kimi_supervisor.systemd import unit

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "testkit" / "fakes" / "fake_vllm.py"
UNIT = unit.UNIT_NAME
CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"
DROPIN = f"/etc/systemd/system/{UNIT}.d/test.conf"

DROPIN_TEXT = """[Service]
RestartSec=1
WatchdogSec=3
TimeoutStopSec=15
"""


def config_toml(argv: list[str], *, readiness: str = "", health: str = "interval_s = 0.5", extra: str = "") -> str:
    """The supervisor's config around ARGV: no GPUs, no model check, quick polls, a 3 s grace."""
    quoted = ", ".join(f'"{a}"' for a in argv)
    return f"""
[child]
argv = [{quoted}]
[preflight]
gpus = []
check_model = false
[readiness]
poll_interval_s = 0.1
{readiness}
[health]
{health}
[shutdown]
grace_s = 3
{extra}
"""


def config(fake_args: list[str], *, health: str = "", extra: str = "") -> str:
    """The fake vLLM (TP 2, 6 shards) with FAKE_ARGS after the defaults (argparse: the last one wins)."""
    argv = [sys.executable, str(FAKE), "serve", "/tmp/model", "--host", "127.0.0.1", "--port", "8000"]
    argv += ["--tensor-parallel-size", "2", "--shards", "6", "--max-lifetime", "120", *fake_args]
    return config_toml(argv, readiness="stall_timeout_s = 30", health=health or "interval_s = 0.5", extra=extra)


def install(m: NspawnMachine) -> str:
    """The checkout's launcher (and its bind drop-in: a checkout under /tmp is hidden by the unit's
    PrivateTmp), the unit running it and the short-timer drop-in; returns the launcher."""
    launcher = checkout.install(m, UNIT)
    m.install_unit(UNIT, unit.render(launcher, Path(CONFIG)), reload=False)
    m.write_file(DROPIN, DROPIN_TEXT)
    m.daemon_reload()
    return launcher


def deploy(m: NspawnMachine, text: str, dropin: str = DROPIN_TEXT) -> None:
    """The unit stopped and reset, then CONFIG and the drop-in replaced: the next start runs them."""
    m.systemctl("stop", UNIT, check=False)
    m.systemctl("reset-failed", UNIT, check=False)
    m.write_file(CONFIG, text, mode=0o644)
    m.write_file(DROPIN, dropin)
    m.daemon_reload()
    m.run(["journalctl", "--rotate"], check=False)


def prop(m: NspawnMachine, name: str) -> str:
    return m.unit_property(UNIT, name)


def now(m: NspawnMachine) -> str:
    """The container's clock, for `journalctl --since`."""
    return m.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()


def cgroup_pids(m: NspawnMachine) -> list[int]:
    return m.unit_pids(UNIT)
