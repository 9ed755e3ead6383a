"""A weight holder and its engine under a real systemd (docs/weight-holder.md): the unit pair install-unit writes.

kimi-supervisor-weights@kimi runs the fake `vllm preload` (kimi.weights.toml), kimi-supervisor@kimi the fake
engine mapping it (kimi.toml, `[weights] holder = true`), each with the drop-in install-unit renders.  Starting
the engine starts the holder first; restarting the engine leaves the holder's main PID and processes alone;
stopping the holder stops the engine first; starting the holder again starts the engine after it.
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
from testkit.fakes.fake_vllm_preload import socket_path

ENGINE = "kimi-supervisor@kimi.service"
HOLDER = "kimi-supervisor-weights@kimi.service"
SOCKETS = "/run/kimi-supervisor/kimi/weight-cache"
COMMON = (
    "[preflight]\ngpus = []\ncheck_model = false\n[readiness]\npoll_interval_s = 0.1\nstall_timeout_s = 30\n"
    "[health]\ninterval_s = 0.5\n[shutdown]\ngrace_s = 3\ngpu_release_timeout_s = 0\n"
)


def quoted(argv: list[str]) -> str:
    return "[" + ", ".join(json.dumps(a) for a in argv) + "]"


def holder_toml() -> str:
    argv = [sys.executable, str(FAKE), "preload", "--model", "/tmp/model", "-tp", "2", "--load-seconds", "1"]
    return (
        f'[child]\nargv = {quoted(argv)}\n[deployment]\nname = "kimi"\nrole = "weights"\n'
        f"[weights]\nhealth_port = 18599\n{COMMON}"
    )


def engine_toml() -> str:
    extra = json.dumps({"socket_dir": SOCKETS, "mode": "zero_copy", "fallback": False})
    argv = [sys.executable, str(FAKE), "serve", "/tmp/model", "--host", "127.0.0.1", "--port", "18598"]
    argv += ["-tp", "2", "--shards", "2", "--load-seconds", "1", "--load-format", "ipc_cache"]
    argv += ["--model-loader-extra-config", extra]
    return (
        f'[child]\nargv = {quoted(argv)}\n[deployment]\nname = "kimi"\n[weights]\nholder = true\nwait_s = 60\n{COMMON}'
    )


@pytest.fixture(scope="module")
def m(machine: NspawnMachine) -> Iterator[NspawnMachine]:
    launcher = checkout.install(machine, unit.TEMPLATE_NAME)
    checkout.install(machine, unit.HOLDER_TEMPLATE_NAME)
    config = Path("/etc/kimi-supervisor/NAME.toml")
    machine.install_unit(unit.TEMPLATE_NAME, unit.render(launcher, config, template=True), reload=False)
    machine.install_unit(unit.HOLDER_TEMPLATE_NAME, unit.render(launcher, config, holder=True), reload=False)
    for name in (unit.TEMPLATE_NAME, unit.HOLDER_TEMPLATE_NAME):
        machine.write_file(f"/etc/systemd/system/{name}.d/test.conf", DROPIN_TEXT)
    # What install-unit writes for this pair (tests/systemd/test_install_unit.py checks that it does).
    machine.write_file(f"/etc/systemd/system/{ENGINE}.d/{unit.DROPIN_NAME}", unit.instance_dropin(15, [], HOLDER))
    machine.write_file(f"/etc/systemd/system/{HOLDER}.d/{unit.DROPIN_NAME}", unit.instance_dropin(15, []))
    machine.write_file("/etc/kimi-supervisor/kimi.weights.toml", holder_toml())
    machine.write_file("/etc/kimi-supervisor/kimi.toml", engine_toml())
    machine.daemon_reload()
    yield machine
    machine.systemctl("stop", ENGINE, HOLDER, check=False, timeout=60)


def props(m: NspawnMachine, name: str) -> dict[str, str]:
    keys = ("ActiveState", "MainPID", "NRestarts", "InactiveEnterTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    # Main: (MainPID, its exec time); a restarted main may get the old PID back in the container's PID namespace.
    return {k: m.unit_property(name, k) for k in keys} | {"Main": str(m.unit_main(name))}


def last_event(m: NspawnMachine, name: str, event: str) -> int:
    out = m.run(["journalctl", "-u", name, "-o", "json", f"KIMI_EVENT={event}"]).stdout
    return int([json.loads(line) for line in out.splitlines()][-1]["__MONOTONIC_TIMESTAMP"])


def test_the_unit_pair(m: NspawnMachine) -> None:
    m.systemctl("start", ENGINE, timeout=120)  # BindsTo= pulls the holder in; After= waits for its READY=1
    holder, engine = props(m, HOLDER), props(m, ENGINE)
    assert holder["ActiveState"] == engine["ActiveState"] == "active", (holder, engine)
    assert int(holder["ActiveEnterTimestampMonotonic"]) <= int(engine["ActiveEnterTimestampMonotonic"])
    state = json.loads(m.run(["cat", "/run/kimi-supervisor/kimi/state.weights.json"]).stdout)
    assert state["phase"] == "ready" and state["supervisor"]["pid"] == int(holder["MainPID"])
    assert m.run(["test", "-S", socket_path(SOCKETS, 1)], check=False).returncode == 0  # vLLM's name for GPU 1

    # The engine's restart never touches the holder.
    holder_tree = sorted(m.unit_pids(HOLDER))
    m.systemctl("restart", ENGINE, timeout=120)
    again = props(m, ENGINE)
    assert again["ActiveState"] == "active" and again["Main"] != engine["Main"]
    assert props(m, HOLDER)["Main"] == holder["Main"] and sorted(m.unit_pids(HOLDER)) == holder_tree

    # Stopping the holder stops the engine first.
    m.systemctl("stop", HOLDER, timeout=120)
    holder_stopped, engine_stopped = props(m, HOLDER), props(m, ENGINE)
    assert holder_stopped["ActiveState"] == engine_stopped["ActiveState"] == "inactive"
    # The engine's supervisor had stopped its tree before the holder's began to stop (the journal's own clock).
    assert last_event(m, ENGINE, "state.stopped") < last_event(m, HOLDER, "state.stopping")

    # Starting the holder (a reload) starts the engine again after it (Wants=).
    m.systemctl("start", HOLDER, timeout=120)
    m.wait_for(lambda: props(m, ENGINE)["ActiveState"] == "active", timeout=60, message="engine not started again")
    assert int(props(m, HOLDER)["ActiveEnterTimestampMonotonic"]) <= int(
        props(m, ENGINE)["ActiveEnterTimestampMonotonic"]
    )


def test_a_holder_crash_reloads_the_holder_then_the_engine(m: NspawnMachine) -> None:
    """The holder's `vllm preload` dies (as on a GPU fault): its supervisor exits 13, systemd restarts the holder
    (Restart=on-failure), the engine is stopped first (BindsTo=) and started again after the new holder (Wants=)."""
    m.systemctl("start", ENGINE, timeout=120)
    holder, engine = props(m, HOLDER), props(m, ENGINE)
    state = json.loads(m.run(["cat", "/run/kimi-supervisor/kimi/state.weights.json"]).stdout)
    [preload] = [p["pid"] for p in state["processes"] if p.get("ppid") == int(holder["MainPID"])]
    m.run(["kill", "-KILL", str(preload)])
    m.wait_for(
        lambda: (
            props(m, HOLDER)["Main"] not in ("(0, 0)", holder["Main"])
            and props(m, HOLDER)["ActiveState"] == "active"
            and props(m, ENGINE)["ActiveState"] == "active"
            and props(m, ENGINE)["Main"] != engine["Main"]
        ),
        timeout=90,
        message="holder and engine not both back",
    )
    after_holder, after_engine = props(m, HOLDER), props(m, ENGINE)
    assert int(after_holder["NRestarts"]) == int(holder["NRestarts"]) + 1
    assert int(after_holder["ActiveEnterTimestampMonotonic"]) <= int(after_engine["ActiveEnterTimestampMonotonic"])
