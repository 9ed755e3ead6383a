"""Two deployments side by side under a real systemd: two instances of the template unit (docs/configuration.md).

kimi-supervisor@kimi-a and kimi-supervisor@kimi-b run /etc/kimi-supervisor/kimi-a.toml and kimi-b.toml, on
disjoint fake GPUs (testkit.fakes.gpu_cli: NVML replaced by a GPU file) and ports, with the default [paths].
Both become READY, each child sees only its own GPUs in PCI bus order and has its own NCCL RAS port
(/proc/PID/environ), each has its own state file and history, `status` tells them apart, restarting one leaves
the other's MainPID, NRestarts and processes alone, and the host-wide lock still refuses a third config that
overlaps one of them (exit 16).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import checkout
import pytest
from nspawn import NspawnMachine
from unit_setup import DROPIN_TEXT, FAKE

from kimi_supervisor.systemd import unit

TEMPLATE = unit.TEMPLATE_NAME
GPU_FILE = "/etc/kimi-test/gpus.json"
# A script named kimi-supervisor running the fake-GPU CLI: a root process with kimi-supervisor's argv, as the
# instance lock requires of a holder whose lock counts (host/instance_lock.py).
FAKE_GPU_SCRIPT = "/usr/local/libexec/kimi-fake-gpus/kimi-supervisor"
FAKE_GPU_LAUNCHER = "/usr/local/libexec/kimi-supervisor-fake-gpus"
DEPLOYMENTS = {"kimi-a": ([0, 1], 18555), "kimi-b": ([2, 3], 18556)}


def instance(name: str) -> str:
    return f"kimi-supervisor@{name}.service"


def config_text(gpus: list[int], port: int) -> str:
    argv = [sys.executable, str(FAKE), "serve", "/tmp/model", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--tensor-parallel-size", "2", "--shards", "4", "--load-seconds", "1", "--max-lifetime", "120"]
    quoted = ", ".join(json.dumps(a) for a in argv)
    return (
        f"[child]\nargv = [{quoted}]\n[preflight]\ngpus = {gpus}\ncheck_model = false\n"
        "[readiness]\npoll_interval_s = 0.1\nstall_timeout_s = 30\n[health]\ninterval_s = 0.5\n"
        "[shutdown]\ngrace_s = 3\ngpu_release_timeout_s = 0\n"
    )


@pytest.fixture(scope="module")
def m(machine: NspawnMachine) -> Iterator[NspawnMachine]:
    checkout.install(machine, TEMPLATE)  # the bind drop-in for every instance, and the checkout's python
    machine.write_file(GPU_FILE, json.dumps([{"total_mib": 97887, "occupants": {}} for _ in range(4)]))
    runner = "import runpy\nrunpy.run_module('testkit.fakes.gpu_cli', run_name='__main__')\n"
    machine.write_file(FAKE_GPU_SCRIPT, runner, mode=0o755)
    machine.write_file(
        FAKE_GPU_LAUNCHER, f'#!/bin/sh\nexec {checkout.PYTHON} {FAKE_GPU_SCRIPT} {GPU_FILE} "$@"\n', mode=0o755
    )
    template = unit.render(FAKE_GPU_LAUNCHER, Path("/etc/kimi-supervisor/NAME.toml"), template=True)
    machine.install_unit(TEMPLATE, template, reload=False)
    machine.write_file(f"/etc/systemd/system/{TEMPLATE}.d/test.conf", DROPIN_TEXT)
    for name, (gpus, port) in DEPLOYMENTS.items():
        machine.write_file(f"/etc/kimi-supervisor/{name}.toml", config_text(gpus, port))
    machine.daemon_reload()
    yield machine
    machine.systemctl("stop", *(instance(n) for n in DEPLOYMENTS), check=False, timeout=60)


def props(m: NspawnMachine, name: str) -> dict[str, str]:
    keys = ("ActiveState", "SubState", "MainPID", "NRestarts", "StatusText")
    # Main: (MainPID, its exec time); a restarted main may get the old PID back in the container's PID namespace.
    return {k: m.unit_property(instance(name), k) for k in keys} | {"Main": str(m.unit_main(instance(name)))}


def status(m: NspawnMachine, *args: str) -> tuple[int, str]:
    r = m.run([checkout.LAUNCHER, "status", *args], check=False, timeout=30)
    return r.returncode, r.stdout


def test_two_instances_side_by_side(m: NspawnMachine) -> None:
    m.systemctl("start", instance("kimi-a"), instance("kimi-b"), timeout=90)  # returns once both sent READY=1
    a, b = props(m, "kimi-a"), props(m, "kimi-b")
    for name, p in (("kimi-a", a), ("kimi-b", b)):
        assert (p["ActiveState"], p["SubState"]) == ("active", "running"), (name, p)
        assert p["StatusText"].startswith(f"ready: serving on http://127.0.0.1:{DEPLOYMENTS[name][1]}"), p
        state = json.loads(m.run(["cat", f"/run/kimi-supervisor/{name}/state.json"]).stdout)
        assert state["supervisor"]["pid"] == int(p["MainPID"]) and state["phase"] == "ready"
        history = json.loads(m.run(["cat", f"/var/lib/kimi-supervisor/{name}/history.json"]).stdout)
        assert [r["pid"] for r in history["runs"]] == [int(p["MainPID"])]  # its own runs only
    # docs/configuration.md: each child runs on its own GPUs only, numbered as NVML numbers them, with its own NCCL RAS
    # endpoint: read from the kernel's copy of the vLLM process's environment, not from what we configured.
    for name, p in (("kimi-a", a), ("kimi-b", b)):
        [child] = m.run(["pgrep", "-P", p["MainPID"]]).stdout.split()
        raw = m.run(["cat", f"/proc/{child}/environ"]).stdout.split("\0")
        env = dict(item.partition("=")[::2] for item in raw if item)
        gpus, _port = DEPLOYMENTS[name]
        assert env.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, gpus)), (name, env)
        assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
        assert env.get("NCCL_RAS_ADDR") == f"127.0.0.1:{28100 + 2 * min(gpus)}"
    # The locks stay in the one host-wide directory, whichever instance took them.
    locks = m.run(["ls", "/run/kimi-supervisor"]).stdout.split()
    assert {"gpu-0.lock", "gpu-3.lock", "port-18555.lock", "port-18556.lock", "kimi-a", "kimi-b"} <= set(locks)
    assert {"port-28100.lock", "port-28104.lock"} <= set(locks)  # each one's NCCL RAS port
    journal = m.run(["journalctl", "-u", instance("kimi-b"), "-o", "json", "KIMI_EVENT=state.ready"]).stdout
    [ready_b] = [json.loads(line) for line in journal.splitlines()]
    assert ready_b["SYSLOG_IDENTIFIER"] == "kimi-supervisor@kimi-b" and ready_b["KIMI_DEPLOYMENT"] == "kimi-b"

    # status: one line each without a name; NAME shows that one in full.
    rc, listed = status(m)
    assert rc == 0, listed
    line_a, line_b = listed.splitlines()
    assert line_a.startswith("● kimi-a   ") and line_a.endswith(f"(PID {a['MainPID']})"), listed
    assert line_b.startswith("● kimi-b   ") and line_b.endswith(f"(PID {b['MainPID']})"), listed
    assert "ready: serving on http://127.0.0.1:18555" in line_a and "127.0.0.1:18556" in line_b
    rc, one = status(m, "kimi-b")
    assert rc == 0 and one.startswith("● kimi-supervisor@kimi-b - ready: serving on http://127.0.0.1:18556"), one
    assert f"Main PID: {b['MainPID']} " in one and "18555" not in one

    # Restarting a never touches b: same main PID, no restart counted, the same processes.
    b_tree = sorted(m.unit_pids(instance("kimi-b")))
    m.systemctl("restart", instance("kimi-a"), timeout=90)
    a2, b2 = props(m, "kimi-a"), props(m, "kimi-b")
    assert a2["ActiveState"] == "active" and a2["Main"] != a["Main"]
    assert (b2["Main"], b2["NRestarts"], b2["ActiveState"]) == (b["Main"], b["NRestarts"], "active")
    assert sorted(m.unit_pids(instance("kimi-b"))) == b_tree

    # A third config overlapping a's GPU 1 and b's 2 (from a shell, by mistake): refused at once, nothing changed.
    # ([1, 2]: its TP 2 needs two GPUs, else the config alone refuses it, exit 78, before any lock is looked at.)
    m.write_file("/etc/kimi-supervisor/kimi-c.toml", config_text([1, 2], 18557))
    third = m.run([FAKE_GPU_LAUNCHER, "--config", "/etc/kimi-supervisor/kimi-c.toml"], check=False, timeout=30)
    assert third.returncode == 16, third.stdout + third.stderr
    assert f"another kimi-supervisor (PID {a2['MainPID']}, unit {instance('kimi-a')}) owns GPU 1" in third.stderr
    assert props(m, "kimi-a")["Main"] == a2["Main"] and props(m, "kimi-b")["Main"] == b["Main"]
    m.run(["rm", "/etc/kimi-supervisor/kimi-c.toml"])
