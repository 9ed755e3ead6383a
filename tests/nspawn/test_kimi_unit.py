"""kimi-supervisor under a real systemd (nspawn): the shipped unit, READY, watchdog, restarts, journald.

The unit is the packaged one with ExecStart pointing at a launcher that runs this checkout's code; a drop-in
shortens the timers so each scenario takes seconds (unit_setup.py; the `m` fixture is conftest's).
"""

from __future__ import annotations

import sys
import threading
import time

import checkout
from nspawn import NspawnMachine, expect_no_restart
from unit_setup import UNIT, cgroup_pids, config, deploy, now, prop

from testkit.harness import HANG_S


def http_status(m: NspawnMachine, url: str) -> str:
    probe = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).status)"
    r = m.run([sys.executable, "-c", probe], check=False)
    return r.stdout.strip() or r.stderr.strip()


def events(m: NspawnMachine, since: str) -> list[str]:
    return [e.get("KIMI_EVENT", "") for e in m.journal_json(UNIT, "--since", since) if e.get("KIMI_EVENT")]


def test_start_returns_after_ready_and_stop_leaves_nothing(m: NspawnMachine) -> None:
    deploy(m, config(["--load-seconds", "4"]))
    since = now(m)
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append((prop(m, "ActiveState"), prop(m, "StatusText")))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    m.systemctl("start", UNIT, timeout=60)
    took = time.monotonic() - start
    done.set()
    watcher.join()

    assert took >= 3.5  # the load takes 4 s: start blocked until READY
    assert prop(m, "ActiveState") == "active" and prop(m, "SubState") == "running"
    assert prop(m, "StatusText").startswith("ready: serving on http://127.0.0.1:8000")
    assert any(state == "activating" and "loading weights" in text for state, text in seen), seen
    assert ("active", "") not in seen
    assert http_status(m, "http://127.0.0.1:8000/health") == "200"

    assert len(cgroup_pids(m)) == 5  # supervisor, APIServer, EngineCore, 2 workers
    m.systemctl("stop", UNIT, timeout=HANG_S)
    assert prop(m, "ActiveState") == "inactive"
    assert prop(m, "ExecMainStatus") == "0"
    assert prop(m, "Result") == "success"  # systemd never had to SIGKILL (was `stop took < 15 s`, a speed)
    assert cgroup_pids(m) == []
    ev = events(m, since)
    assert "stop.sigkill" not in ev  # the tree ended at SIGTERM
    assert ev.index("state.ready") < ev.index("state.stopping") < ev.index("stop.tree_gone") < ev.index("state.stopped")
    # The shipped unit's seccomp filter (@system-service) lets pidfd_open through: the child's exit wakes the loop
    # at once (lifecycle/reactor.py), never the 0.1 s poll it falls back to.
    assert "reactor.exit_polled" not in ev


def test_the_unit_runs_this_checkouts_code(m: NspawnMachine) -> None:
    # Under the same sandbox as the unit (PrivateTmp hides a checkout cloned under /tmp otherwise).
    binds = [f"--property=BindReadOnlyPaths={b}" for b in checkout.binds_ro()]
    probe = "import kimi_supervisor, sys; print(kimi_supervisor.__file__); print(sys.executable)"
    r = m.run(
        [
            "systemd-run",
            "--wait",
            "--pipe",
            "--quiet",
            "--property=PrivateTmp=yes",
            *binds,
            checkout.PYTHON,
            "-c",
            probe,
        ]
    )
    assert r.stdout.split() == [str(checkout.REPO_ROOT / "kimi_supervisor" / "__init__.py"), sys.executable]
    deploy(m, config(["--load-seconds", "1"]))
    m.systemctl("start", UNIT, timeout=60)
    main = prop(m, "MainPID")
    cmdline = m.read_file(f"/proc/{main}/cmdline").split("\0")
    assert cmdline[:3] == [sys.executable, "-m", "kimi_supervisor"], cmdline
    assert f"PYTHONPATH={checkout.REPO_ROOT}" in m.read_file(f"/proc/{main}/environ").split("\0")
    m.systemctl("stop", UNIT)


def test_child_crash_after_ready_restarts_the_unit(m: NspawnMachine) -> None:
    deploy(m, config(["--load-seconds", "1", "--kill-worker-after-ready", "1"]))
    since = now(m)
    m.systemctl("start", UNIT, timeout=60)
    m.wait_for(lambda: int(prop(m, "NRestarts")) >= 1, timeout=30, message="no restart after the crash")
    journal = m.journal(UNIT, "--since", since)
    assert "vLLM reported a fatal error after it was ready: " in journal and "died unexpectedly" in journal
    assert f"{UNIT}: Main process exited, code=exited, status=13/n/a" in journal
    m.systemctl("stop", UNIT)


def test_watchdog_restarts_a_hung_server(m: NspawnMachine) -> None:
    # The supervisor tolerates many failures, so only the watchdog can notice the hang.
    deploy(
        m,
        config(
            ["--load-seconds", "1", "--hang-after-ready", "1"],
            health="interval_s = 0.5\ntimeout_s = 0.5\nfailures_tolerated = 1000",
        ),
    )
    since = now(m)
    m.systemctl("start", UNIT, timeout=60)
    m.wait_for(lambda: int(prop(m, "NRestarts")) >= 1, timeout=40, message="no watchdog restart")
    journal = m.journal(UNIT, "--since", since)
    assert f"{UNIT}: Watchdog timeout (limit 3s)!" in journal
    m.systemctl("stop", UNIT)


def test_config_error_fails_without_restart_loop(m: NspawnMachine) -> None:
    deploy(m, "[child]\nargv = []\n")
    since = now(m)
    m.systemctl("start", UNIT, check=False, timeout=30)
    m.wait_for(lambda: prop(m, "ActiveState") == "failed", timeout=20, message="unit did not fail")
    expect_no_restart(m, UNIT)
    assert prop(m, "ExecMainStatus") == "78"
    assert prop(m, "NRestarts") == "0"
    assert "child.argv: expected a non-empty array of strings, got an empty array" in m.journal(UNIT, "--since", since)


def test_supervisor_sigkilled_then_next_start_finds_nothing_stale(m: NspawnMachine) -> None:
    deploy(m, config(["--load-seconds", "1"]))
    since = now(m)
    m.systemctl("start", UNIT, timeout=60)
    main = m.unit_main(UNIT)  # with its exec time: the restarted main may get the same PID back
    assert len(cgroup_pids(m)) == 5  # supervisor, APIServer, EngineCore, 2 workers
    m.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", UNIT)
    # KillMode=mixed: the rest of the cgroup is killed; Restart=on-failure starts it again.
    m.wait_for(
        lambda: m.unit_main(UNIT) not in ((0, 0), main) and prop(m, "ActiveState") == "active",
        timeout=40,
        message="not restarted after SIGKILL",
    )
    ev = events(m, since)
    assert ev.count("state.ready") == 2
    assert "preflight.kill" not in ev  # nothing stale: systemd killed the old tree
    journal = m.journal(UNIT, "--since", since)
    assert "already in use" not in journal
    m.systemctl("stop", UNIT)
    assert cgroup_pids(m) == []


def test_journal_priorities_and_fields(m: NspawnMachine) -> None:
    deploy(m, config(["--crash-during-load", "--load-seconds", "1"]))
    since = now(m)
    m.systemctl("start", UNIT, check=False, timeout=60)
    m.wait_for(lambda: "state.failed" in events(m, since), timeout=30, message="no failure event")
    m.systemctl("stop", UNIT, check=False)
    records = m.journal_json(UNIT, "--since", since)
    child = [r for r in records if r.get("KIMI_SOURCE") == "child"]
    sup = [r for r in records if r.get("KIMI_SOURCE") == "supervisor"]
    assert child and sup
    worker = [r for r in child if r.get("VLLM_COMPONENT") == "Worker" and r.get("VLLM_RANK") == "0"]
    assert worker and all(r["VLLM_PID"].isdigit() for r in worker)
    assert any(r["PRIORITY"] == "6" and "INFO" in r["MESSAGE"] for r in child)
    assert any(r["PRIORITY"] == "3" and "OutOfMemoryError" in r["MESSAGE"] for r in child)
    failed = next(r for r in sup if r["KIMI_EVENT"] == "state.failed")
    assert failed["PRIORITY"] == "3" and failed["KIMI_EXIT_CODE"] == "11"
    err_only = m.journal(UNIT, "--since", since, "-p", "err")
    assert "OutOfMemoryError" in err_only and "Loading safetensors" not in err_only
    by_event = m.journal(UNIT, "--since", since, "KIMI_EVENT=state.starting")
    assert "state.starting" in by_event and "Loading safetensors" not in by_event


def test_security_exposure_at_most_3_2(m: NspawnMachine) -> None:
    # The loaded unit, as the running systemd sees it (the drop-ins included); tests/systemd/test_unit.py
    # scores the shipped files offline, and test_instances.py runs the template's instances under the same.
    out = m.run(["systemd-analyze", "security", "--no-pager", UNIT], check=False).stdout
    line = next(x for x in out.splitlines() if "Overall exposure level" in x)
    score = float(line.split(":")[1].split()[0])
    assert score <= 3.2, line  # docs/hardening.md: 3.0 plus CAP_CHOWN
