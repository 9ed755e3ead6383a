"""Prove the nspawn harness: Type=notify, READY/STATUS, watchdog, journald,
RestartPreventExitStatus and systemd-analyze verify against a real systemd."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from nspawn import (
    DEFAULT_BASE_DIR,
    DIR_PREFIX,
    NspawnError,
    NspawnMachine,
    _mounts_under,
    expect_no_restart,
    needs_bind,
    timespan_s,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# The host interpreter is visible inside (overlay of /, or bound by conftest).
PY = sys.executable
SCRIPT = "/opt/kimi-harness/notify_demo.py"

# Raw sd_notify over a datagram socket; behaviour driven by the environment:
#   READY_DELAY  seconds before READY=1          (default 2)
#   PING_FOR     seconds of WATCHDOG=1 pings after READY, then go silent
#                (default: forever)
#   EXIT_CODE    exit with this code right away (no notifications)
NOTIFY_DEMO = r"""
import os, socket, sys, time

def notify(msg: str) -> None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(msg.encode())

if "EXIT_CODE" in os.environ:
    print("<3>demo: exiting with", os.environ["EXIT_CODE"], file=sys.stderr, flush=True)
    sys.exit(int(os.environ["EXIT_CODE"]))

print("<6>demo: info line", flush=True)
print("<3>demo: error line for priority test", file=sys.stderr, flush=True)
notify("STATUS=starting up")
time.sleep(float(os.environ.get("READY_DELAY", "2")))
notify("READY=1\nSTATUS=ready and serving")
interval = int(os.environ.get("WATCHDOG_USEC", "2000000")) / 1e6 / 4
ping_for = float(os.environ.get("PING_FOR", "inf"))
t0 = time.monotonic()
while True:
    if time.monotonic() - t0 < ping_for:
        notify("WATCHDOG=1")
    time.sleep(interval)
"""


def unit(
    description: str,
    env: dict[str, str],
    *,
    type_: str = "notify",
    extra: str = "",
) -> str:
    envs = "\n".join(f"Environment={k}={v}" for k, v in env.items())
    return f"""\
[Unit]
Description={description}
StartLimitIntervalSec=0

[Service]
Type={type_}
ExecStart={PY} -u {SCRIPT}
{envs}
Restart=on-failure
RestartSec=500ms
LimitCORE=0
TimeoutStartSec=20
{extra}
"""


@pytest.fixture(scope="module", autouse=True)
def demo_script(machine: NspawnMachine) -> None:
    machine.write_file(SCRIPT, NOTIFY_DEMO, 0o755)


@dataclass
class StartObservation:
    name: str
    seconds: float  # how long the blocking `systemctl start` took
    states_while_blocked: set[str]
    status_while_blocked: str
    blocked_at_status: bool  # systemctl start still blocked when STATUS seen


@pytest.fixture(scope="module")
def started_demo(machine: NspawnMachine) -> StartObservation:
    """Start notify-demo.service (READY after 2 s) with a blocking
    `systemctl start` in a thread while observing the unit from outside."""
    name = "notify-demo.service"
    machine.install_unit(name, unit("notify demo", {"READY_DELAY": "2"}, extra="WatchdogSec=2"))
    done: list[float] = []

    def start() -> None:
        t0 = time.monotonic()
        machine.systemctl("start", name)
        done.append(time.monotonic() - t0)

    th = threading.Thread(target=start, daemon=True)
    th.start()
    # While `systemctl start` blocks, the unit is activating, STATUS visible.
    machine.wait_for_property(name, "ActiveState", "activating", timeout=5)
    machine.wait_for_property(name, "StatusText", "starting up", timeout=5)
    blocked = th.is_alive()
    states = {machine.unit_property(name, "ActiveState")}
    status = machine.unit_property(name, "StatusText")
    th.join(timeout=20)
    assert done, "systemctl start did not return"
    return StartObservation(name, done[0], {"activating"} | states, status, blocked)


def test_start_blocks_until_ready(machine: NspawnMachine, started_demo: StartObservation) -> None:
    obs = started_demo
    assert obs.blocked_at_status, "systemctl start returned before READY=1"
    assert obs.states_while_blocked == {"activating"}
    assert obs.status_while_blocked == "starting up"
    assert obs.seconds >= 2.0, f"start returned after {obs.seconds:.2f}s, before READY"
    assert machine.unit_property(obs.name, "ActiveState") == "active"
    assert machine.unit_property(obs.name, "SubState") == "running"


def test_status_text_visible(machine: NspawnMachine, started_demo: StartObservation) -> None:
    name = started_demo.name
    assert machine.unit_property(name, "StatusText") == "ready and serving"
    # `systemctl status` exits 0 for an active unit.
    out = machine.systemctl("status", name).stdout
    assert 'Status: "ready and serving"' in out
    assert machine.unit_property(name, "WatchdogUSec") == "2s"


def test_journal_priority(machine: NspawnMachine, started_demo: StartObservation) -> None:
    name = started_demo.name

    def entries() -> list[dict[str, object]]:
        return [e for e in machine.journal_json(name) if str(e.get("MESSAGE", "")).startswith("demo:")]

    def two_entries() -> list[dict[str, object]]:
        e = entries()
        return e if len(e) >= 2 else []

    got = machine.wait_for(two_entries, 10, message="journal")
    prio = {str(e["MESSAGE"]): e["PRIORITY"] for e in got}
    assert prio["demo: error line for priority test"] == "3"
    assert prio["demo: info line"] == "6"
    err = machine.journal(name, "-p", "err", "-o", "cat")
    assert "demo: error line for priority test" in err
    assert "demo: info line" not in err


def test_watchdog_kills_and_restarts(machine: NspawnMachine) -> None:
    name = "wd-demo.service"
    machine.install_unit(
        name,
        unit("watchdog demo", {"READY_DELAY": "0", "PING_FOR": "1"}, extra="WatchdogSec=1"),
    )
    machine.systemctl("start", name)
    t0 = time.monotonic()
    machine.wait_for(lambda: int(machine.unit_property(name, "NRestarts")) >= 1, 15, message="a restart")
    elapsed = time.monotonic() - t0

    def watchdog_log() -> str:
        j = machine.journal(name)
        return j if "Watchdog timeout" in j else ""

    log = machine.wait_for(watchdog_log, 5, message="'Watchdog timeout' in journal")
    assert "Killing process" in log and "SIGABRT" in log
    assert "Failed with result 'watchdog'" in log
    # 1 s of pings + 1 s watchdog + 0.5 s RestartSec, minus slack.
    assert elapsed >= 1.0
    machine.systemctl("stop", name)


def test_restart_prevent_exit_status(machine: NspawnMachine) -> None:
    name = "exit78-demo.service"
    machine.install_unit(
        name,
        unit("exit 78", {"EXIT_CODE": "78"}, type_="simple", extra="RestartPreventExitStatus=78"),
    )
    machine.systemctl("start", name)
    machine.wait_for_property(name, "ActiveState", "failed", timeout=10)
    expect_no_restart(machine, name)
    assert machine.unit_property(name, "Result") == "exit-code"
    assert machine.unit_property(name, "ExecMainStatus") == "78"

    # Contrast: any other failing exit code is restarted.
    other = "exit1-demo.service"
    machine.install_unit(
        other,
        unit("exit 1", {"EXIT_CODE": "1"}, type_="simple", extra="RestartPreventExitStatus=78"),
    )
    machine.systemctl("start", other)
    machine.wait_for(lambda: int(machine.unit_property(other, "NRestarts")) >= 1, 10, message="restart")
    with pytest.raises(AssertionError):
        expect_no_restart(machine, other)
    machine.systemctl("stop", other)
    machine.systemctl("reset-failed", check=False)


def test_systemd_analyze_verify(machine: NspawnMachine) -> None:
    good = unit("verify me", {"A": "1"}, extra="WatchdogSec=5")
    machine.write_file("/tmp/verify/good.service", good)
    r = machine.run(["systemd-analyze", "verify", "/tmp/verify/good.service"], check=False)
    assert r.returncode == 0, r.stderr

    bad = good.replace("Type=notify", "Type=bogus").replace(f"ExecStart={PY}", "ExecStart=py")
    machine.write_file("/tmp/verify/bad.service", bad)
    r = machine.run(["systemd-analyze", "verify", "/tmp/verify/bad.service"], check=False)
    assert r.returncode != 0
    assert "bogus" in r.stderr or "Neither a valid executable" in r.stderr, r.stderr


def test_python_module_from_repo_checkout(machine: NspawnMachine) -> None:
    """A unit can run `python -m pkg` from the bound, read-only repo checkout."""
    r = machine.run(
        [
            "systemd-run",
            "--wait",
            "--pipe",
            "--quiet",
            f"--working-directory={REPO_ROOT}",
            f"--setenv=PYTHONPATH={REPO_ROOT}",
            "--setenv=PYTHONDONTWRITEBYTECODE=1",
            PY,
            "-c",
            "import tests.nspawn.nspawn as n, sys; print(n.__file__); print(sys.version_info[:2])",
        ]
    )
    assert r.stdout.splitlines()[0] == str(REPO_ROOT / "tests/nspawn/nspawn.py")
    assert r.stdout.splitlines()[1] == str(sys.version_info[:2])


def _our_dirs() -> set[str]:
    """This process's harness dirs (other pytest processes may run in parallel)."""
    mine = f"{DIR_PREFIX}{os.getpid()}-"
    return {p for p in os.listdir(DEFAULT_BASE_DIR) if p.startswith(mine)}


@pytest.mark.usefixtures("nspawn_required")
def test_teardown_after_boot_failure() -> None:
    """Boot failure raises NspawnError carrying nspawn's output and still
    cleans up (no mounts, no temp dir, nspawn reaped)."""
    before = _our_dirs()
    m = NspawnMachine(binds_ro=["/nonexistent/kimi-harness-path"], boot_timeout=20)
    with pytest.raises(NspawnError) as ei, m:
        pass
    assert "nonexistent" in str(ei.value)  # nspawn's own error message
    assert m.root is None and m.teardown_seconds is not None
    assert _our_dirs() <= before


@pytest.mark.usefixtures("nspawn_required")
def test_teardown_after_test_failure() -> None:
    m = NspawnMachine(shutdown_timeout=120.0)  # only a hang's bound: a busy host's poweroff is still a poweroff
    with pytest.raises(AssertionError), m:
        root = m.root
        pid1, nspawn_pid = m.pid1, m.nspawn_pid
        assert root is not None and Path(root, "merged/etc").is_dir()
        raise AssertionError("simulated test failure")
    assert root is not None and not root.exists()
    assert not _mounts_under(str(root))
    for pid in (pid1, nspawn_pid):
        assert not Path(f"/proc/{pid}").exists(), f"pid {pid} still alive"
    # systemd's own poweroff, not the SIGKILL once shutdown_timeout ran out (was `teardown < 10 s`, a speed).
    assert m.stopped_by == "poweroff", m.teardown_seconds


def test_run_timeout_and_env_isolation(machine: NspawnMachine) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        machine.run(["sleep", "5"], timeout=0.5)
    env = machine.run(["env"]).stdout
    assert "PYTEST_CURRENT_TEST" not in env and "PATH=/usr/local/sbin" in env
    assert machine.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"


def test_factory_rw_bind_and_needs_bind(machine_factory: Callable[..., NspawnMachine], tmp_path: Path) -> None:
    """Host dirs under /tmp are hidden by the container's /tmp tmpfs unless
    bound; a rw bind is shared both ways."""
    assert needs_bind(str(tmp_path)) and not needs_bind("/usr/bin")  # the checkout may be under /tmp too
    (tmp_path / "from_host").write_text("h")
    m = machine_factory(binds_rw=[str(tmp_path)])
    assert m.read_file(str(tmp_path / "from_host")) == "h"
    m.write_file(str(tmp_path / "from_container"), "c\n", 0o600)
    assert (tmp_path / "from_container").read_text() == "c\n"
    assert (tmp_path / "from_container").stat().st_mode & 0o777 == 0o600
    assert m.boot_state in ("running", "degraded")


def test_timespan_as_systemctl_show_prints_it() -> None:
    assert timespan_s("500ms") == 0.5
    assert timespan_s("15s") == 15.0
    assert timespan_s("1min 30s") == 90.0
    assert timespan_s("0") == 0.0
    with pytest.raises(ValueError):
        timespan_s("infinity")


def test_two_containers_at_once_see_only_their_own_units(machine_factory: Callable[..., NspawnMachine]) -> None:
    """Each container runs in a cgroup subtree of its own: the same unit name, started in two machines
    at once, lists only that machine's processes (sharing nspawn's default `payload` cgroup, each
    listed both)."""
    a, b = machine_factory(), machine_factory()
    for m, sleepers in ((a, 1), (b, 2)):
        m.run(["systemd-run", "--unit=twin.service", "sh", "-c", "sleep 300 & " * sleepers + "wait"])
    for m, expected in ((a, 2), (b, 3)):  # sh plus its sleepers
        m.wait_for(
            lambda m=m, n=expected: len(m.unit_pids("twin.service")) >= n, 10, message="twin.service's processes"
        )
    assert len(a.unit_pids("twin.service")) == 2 and len(b.unit_pids("twin.service")) == 3
    host_cgroups = {Path(f"/proc/{m.pid1}/cgroup").read_text() for m in (a, b)}
    assert len(host_cgroups) == 2, host_cgroups
    for m in (a, b):
        m.systemctl("stop", "twin.service")
        assert m.unit_pids("twin.service") == []
