"""`kimi-supervisor status` under the real systemd: progress and ETA during a load, the previous run after a restart."""

from __future__ import annotations

import json
import subprocess
import time

import checkout
from nspawn import NspawnMachine
from unit_setup import CONFIG, UNIT, config, deploy, prop

# The plain unit's deployment (its config is kimi-supervisor.toml): its own directory below the host-wide ones.
STATE_FILE = "/run/kimi-supervisor/kimi-supervisor/state.json"
HISTORY_FILE = "/var/lib/kimi-supervisor/kimi-supervisor/history.json"


def status(m: NspawnMachine, *args: str) -> subprocess.CompletedProcess[str]:
    # This checkout's code, as the unit runs it (an operator's shell would find the installed one).
    return m.run([checkout.LAUNCHER, "status", "--config", CONFIG, *args], check=False)


def wait_for_report(m: NspawnMachine, needles: tuple[str, ...], timeout: float = 40) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = status(m).stdout
        if all(n in seen for n in needles):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"no report with {needles} within {timeout}s; last one:\n{seen}")


def test_status_during_a_load_and_after_a_restart(m: NspawnMachine) -> None:
    deploy(m, config(["--load-seconds", "14", "--shards", "40"]))
    # The machine may have served other tests' runs: start from no state file and no history.
    m.run(["rm", "-f", STATE_FILE, HISTORY_FILE])
    none = status(m)
    assert none.returncode == 3 and f"not running (no state file at {STATE_FILE})" in none.stdout

    m.systemctl("start", "--no-block", UNIT)
    # The first load has no history: the ETA comes from the shard rate once shards load.
    loading = wait_for_report(m, ("- starting: loading weights ", "Progress: [", "left (shard rate)"))
    assert status(m).returncode == 0
    assert "Worker_TP1" in loading and "└─" in loading
    mode = m.run(["stat", "-c", "%a %U", STATE_FILE]).stdout.split()
    assert mode == ["644", "root"]
    # No root needed to read it (the unit runs with UMask=0077).
    as_nobody = m.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "cat", STATE_FILE], check=False)
    assert as_nobody.returncode == 0 and json.loads(as_nobody.stdout)["phase"] in ("starting", "ready")

    m.wait_for(lambda: prop(m, "ActiveState") == "active", timeout=60, message="not ready")
    first_ready = wait_for_report(m, ("- ready: serving on http://127.0.0.1:8000", "Health: ok, "))
    assert "Uptime: ready for " in first_ready

    m.systemctl("restart", "--no-block", UNIT)
    # The second load predicts its duration from the first before any shard loads.
    second = wait_for_report(m, ("- starting: ", "left (last load)"))
    assert "Last 2 runs, newest first (2 starts recorded):" in second
    previous = second.split("Last 2 runs", 1)[1].splitlines()[3]
    assert previous.rstrip().endswith("0  stopped on request"), second
    m.wait_for(lambda: prop(m, "ActiveState") == "active", timeout=60, message="not ready after the restart")

    [data] = json.loads(status(m, "--json").stdout)
    assert data["running"] is True and data["state"]["phase"] == "ready"
    assert [r["exit_code"] for r in data["runs"]] == [None, 0]
    assert data["counters"]["starts_total"] == 2

    m.systemctl("stop", UNIT)
    after = status(m)
    assert after.returncode == 3 and "not running (stopped at " in after.stdout
