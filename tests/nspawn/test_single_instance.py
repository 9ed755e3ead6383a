"""Instance locks (docs/kill-safety.md), real systemd: a second kimi-supervisor by hand leaves the serving unit be.

The unit and the shell both run this checkout (tests/nspawn/checkout.py's launcher).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from checkout import LAUNCHER
from nspawn import NspawnMachine
from unit_setup import CONFIG, UNIT, cgroup_pids, config, deploy, install, prop

WRAPPER = LAUNCHER  # this checkout's `python -m kimi_supervisor`, for the unit and for the shell


@pytest.fixture(scope="module")
def m(machine: NspawnMachine) -> Iterator[NspawnMachine]:
    assert install(machine) == WRAPPER  # the unit runs the launcher the shell runs below
    yield machine


def test_second_supervisor_from_a_shell_leaves_the_unit_alone(m: NspawnMachine) -> None:
    deploy(m, config(["--load-seconds", "1"]))
    m.systemctl("start", UNIT, timeout=90)  # returns once READY=1
    main = prop(m, "MainPID")
    ident = m.unit_main(UNIT)  # "the same process" later: PID and exec time, not the PID alone
    tree = sorted(cgroup_pids(m))
    assert prop(m, "ActiveState") == "active" and prop(m, "NRestarts") == "0"
    try:
        started = time.monotonic()
        second = m.run([WRAPPER, "--config", CONFIG], check=False, timeout=30)
        took = time.monotonic() - started
        assert second.returncode == 16, second.stdout + second.stderr
        lines = [json.loads(line) for line in second.stderr.splitlines() if line.startswith("{")]
        assert [e["event"] for e in lines] == ["supervisor.exit"]
        assert lines[0]["error"].startswith(f"another kimi-supervisor (PID {main}, unit {UNIT}) owns port 8000")
        dry = m.run([WRAPPER, "--config", CONFIG, "--dry-run"], check=False, timeout=30)
        assert dry.returncode == 16
        assert f"a kimi-supervisor (PID {main}, unit {UNIT}) is running" in dry.stdout
        time.sleep(2)  # several health probes and watchdog pings later
        assert prop(m, "ActiveState") == "active" and prop(m, "SubState") == "running"
        assert prop(m, "NRestarts") == "0" and m.unit_main(UNIT) == ident
        assert sorted(cgroup_pids(m)) == tree
        print(f"second instance refused in {took * 1000:.0f} ms (nsenter included)")
    finally:
        m.systemctl("stop", UNIT, check=False, timeout=60)
