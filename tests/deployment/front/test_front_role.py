"""The front as a role (docs/front.md): its config (`NAME.front.toml`, role "front", `[front]`, no `[child]`), the
one place it is chosen, its names, and the real CLI running it: READY=1 once it listens, forwarding to a
stand-in engine on the deployment's socket, a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest

from kimi_supervisor.config import layout
from kimi_supervisor.config.front import engine_socket
from kimi_supervisor.config.load import load_config
from kimi_supervisor.deployment.choose import for_config
from kimi_supervisor.deployment.front.role import Front
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.roles import Role
from testkit.harness import Run, write_config
from testkit.procutil import free_port
from tests.deployment.front.fake_engine import FakeEngine
from tests.deployment.front.harness import BOUND_S, until


def _front_config(directory: Path, port: int, **front: object) -> Path:
    runtime, state = directory / "run", directory / "state"
    return write_config(
        directory / "kimi-a.front.toml",
        {
            "deployment": {"name": "kimi-a", "role": "front"},
            "front": {"host": "127.0.0.1", "port": port, **front},
            "paths": {"runtime_directory": str(runtime), "state_directory": str(state)},
        },
    )


def test_a_fronts_config_is_its_front_table_and_no_child(tmp_path: Path) -> None:
    cfg = load_config(_front_config(tmp_path, 8000, queue_max=7, allow_routes=["/pause"]))
    assert cfg.role is Role.FRONT and cfg.child.argv == () and cfg.preflight.gpus == ()
    assert cfg.front is not None
    assert (cfg.front.port, cfg.front.queue_max, cfg.front.allow_routes) == (8000, 7, ("/pause",))
    assert cfg.front.engine_socket == engine_socket(tmp_path / "run", "kimi-a")
    assert cfg.front.engine_socket == tmp_path / "run" / "kimi-a" / "front" / "engine.sock"
    assert cfg.front.engine_state_file == tmp_path / "run" / "kimi-a" / "state.json"
    role = for_config(cfg)
    assert isinstance(role, Front)
    assert (role.serving_port, role.lock_suffix, role.ras_port) == (8000, ".front", None)
    assert layout.unit_name("kimi-a", Role.FRONT) == "kimi-supervisor-front@kimi-a"
    assert layout.of(cfg).state_file.name == "state.front.json"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"deployment": {"role": "front"}, "front": {}, "child": {"argv": ["vllm"]}},
            "{p}: child: deployment.role = 'front' runs no child (docs/front.md): remove [child]",
        ),
        (
            {"child": {"argv": ["vllm", "serve", "/m"]}, "front": {"port": 8000}},
            "{p}: front: [front] is for a front's config (deployment.role = \"front\"), not 'engine'",
        ),
        (
            {"deployment": {"role": "front"}, "front": {"port": 0}},
            "{p}: front.port: expected an integer between 1 and 65535, got 0",
        ),
        (
            {"deployment": {"role": "front"}, "front": {"allow_routes": ["pause"]}},
            "{p}: front.allow_routes[0]: expected a path starting with '/', got 'pause'",
        ),
        (
            {"deployment": {"role": "front"}, "front": {"hold": 3}},
            "{p}: front.hold: unknown key (did you mean 'hold_s'?)",
        ),
    ],
)
def test_a_wrong_front_config_is_one_line_naming_the_key(
    tmp_path: Path, sections: dict[str, dict[str, object]], message: str
) -> None:
    path = write_config(tmp_path / "kimi-a.front.toml", sections)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.message == message.format(p=path)


AS_STARTED = "the account it starts as (no child.user)"


def _dry(config: Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, tuple[str, str]]]:
    from tests.cli.test_entry import cli

    done = cli("--config", str(config), "--dry-run", "--json", env=env)
    rows = {c["name"]: (c["status"], c["message"]) for c in json.loads(done.stdout)["checks"]}
    return done.returncode, rows


def test_a_fronts_dry_run_is_the_verdict_of_its_start_and_runs_no_preflight(tmp_path: Path) -> None:
    """Its engine's config without what the front needs is FAILED (exit 10), as the start refuses it (78); was: a
    warning and "a start would proceed".  Without an engine config the start proceeds and holds: a warning."""
    config = _front_config(tmp_path, free_port())
    sock = engine_socket(tmp_path / "run", "kimi-a")
    code, rows = _dry(config)
    assert code == 0 and sorted(rows) == ["front", "front_engine", "front_http", "port"]  # no GPU, shm or model rows
    assert rows["front_engine"] == ("warn", f"{tmp_path}/kimi-a.toml: no engine config beside the front's")
    assert rows["front_http"][0] == "ok"
    engine = tmp_path / "kimi-a.toml"
    engine.write_text(f'[child]\nargv = ["vllm", "serve", "/m", "--uds", "{sock}"]\n')
    code, rows = _dry(config)
    assert (code, rows["front_engine"]) == (
        10,
        (
            "failed",
            f"{engine}: child.argv lacks --enable-scale-out (a broken stream's resume needs /inference/v1/generate), "
            "which its front needs (docs/front.md)",
        ),
    )
    engine.write_text(f'[child]\nargv = ["vllm", "serve", "/m", "--uds", "{sock}", "--enable-scale-out"]\n')
    code, rows = _dry(config)
    assert (code, rows["front_engine"]) == (
        0,
        ("ok", f"{engine}: vLLM serves on {sock}, scale-out on; the front serves as {AS_STARTED}"),
    )
    engine.write_text("[child]\nargv = []\n")  # a start exits 78 reading it: so does the verdict say
    code, rows = _dry(config)
    assert code == 10 and rows["front_engine"][0] == "failed" and "child.argv" in rows["front_engine"][1]


def test_a_fronts_public_port_taken_fails_its_dry_run_and_its_start_naming_the_owner(tmp_path: Path) -> None:
    import os
    import socket

    from tests.cli.test_entry import cli

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = _front_config(tmp_path, port)
        code, rows = _dry(config)
        owner = f"by PID {os.getpid()}"
        assert code == 10 and rows["port"][0] == "failed", rows["port"]
        assert rows["port"][1].startswith(f"port {port} on 127.0.0.1 is already in use {owner}"), rows["port"]
        done = cli("--config", str(config), "--log-format", "json")
        assert done.returncode == 10
        [exit_record] = [r for r in map(json.loads, done.stderr.splitlines()) if r["event"] == "supervisor.exit"]
        assert exit_record["error"].startswith(
            f"front.port: cannot listen on 127.0.0.1:{port}: Address already in use {owner}"
        )


def test_a_front_without_its_http_stack_fails_its_dry_run_and_exits_78_with_the_install_line(tmp_path: Path) -> None:
    """Was: the dry run said a start would proceed, and the start crashed on the import (exit 70, "a bug"), restarted
    by systemd in a loop."""
    import sys

    shadow = tmp_path / "shadow" / "aiohttp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'aiohttp'\")\n")
    env = {"PYTHONPATH": str(shadow.parent)}
    config = _front_config(tmp_path, free_port())
    line = f"install it: {sys.executable} -m pip install 'aiohttp>=3.14,<4'"
    code, rows = _dry(config, env)
    assert code == 10 and rows["front_http"][0] == "failed" and rows["front_http"][1].endswith(line), rows
    from tests.cli.test_entry import cli

    done = cli("--config", str(config), "--log-format", "json", env=env)
    assert done.returncode == 78
    last = done.stderr.splitlines()[-1]  # the one line a config error is, after the start's log records
    assert last.startswith("kimi-supervisor: config error: the front needs aiohttp>=3.14,<4: it cannot be imported")
    assert last.endswith(line)


def test_the_cli_runs_the_front_ready_once_it_listens_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    config = _front_config(tmp_path, port)
    sock = engine_socket(tmp_path / "run", "kimi-a")
    sock.parent.mkdir(parents=True)
    engine = FakeEngine(sock)

    async def scenario() -> None:
        await engine.start()
        run = Run(config, tmp_path, env={"WATCHDOG_USEC": "2000000"})  # systemd's WatchdogSec=2
        try:
            await asyncio.to_thread(run.wait_event, "front.listening", BOUND_S)
            ready = await asyncio.to_thread(_wait_notify, run, "READY", "1")
            assert ready is not None
            # Its loop pings the watchdog (at most every second here), and its headline says the engine serves.
            assert await asyncio.to_thread(_wait_notify, run, "WATCHDOG", "1") is not None
            serving = await asyncio.to_thread(
                _wait_notify, run, "STATUS", f"serving: engine up, 127.0.0.1:{port} (no spare)"
            )
            assert serving is not None
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with (
                aiohttp.ClientSession() as client,
                client.post(url, json={"prompt": "hi", "max_tokens": 2}) as answer,
            ):
                assert answer.status == 200
                assert (await answer.json())["choices"][0]["text"]
            # An outage: the request sent during it is held, and the front's state file (which `status` shows)
            # counts it against that outage.
            state_file = tmp_path / "run" / "kimi-a" / "front-state" / "state.front.json"
            await engine.crash()
            await until(lambda: _front_doc(state_file).get("engine_serving") is False, "the outage in the state file")
            async with aiohttp.ClientSession() as client:
                held = asyncio.ensure_future(client.post(url, json={"prompt": "hi", "max_tokens": 2}))
                await until(lambda: _front_doc(state_file).get("held") == 1, "the request held")
                await engine.restart()
                async with await asyncio.wait_for(held, BOUND_S) as answer:
                    assert answer.status == 200
            await until(lambda: (_front_doc(state_file).get("requests") or {}).get("held") == 1, "counted held")
            [outage] = _front_doc(state_file)["outages"]
            assert outage["ended"] >= outage["began"] and outage["held"] == 1 and outage["failed"] == 0
            assert outage["client_wait_s"] > 0
            # Its own `status` pane (status --config NAME.front.toml): its config, ready since it listens, and its
            # outages where an engine's runs would be (was: a blank Config, "not ready yet" under "Phase: ready",
            # an engine's Health and Watchdog rows, "No runs recorded yet.").
            pane = await asyncio.to_thread(_status_pane, config)
            assert f"      Config: {config}\n" in pane and "ready for " in pane, pane
            for wrong in ("not ready yet", "No runs recorded", "Health:", "Watchdog:"):
                assert wrong not in pane, pane
            assert "       Front: ready, engine serving, 0 held now; 1 outage(s), the last " in pane, pane
            run.signal(signal.SIGTERM)
            assert await asyncio.to_thread(run.wait, BOUND_S) == 0
            assert run.notify.first("STOPPING", "1") is not None
            assert json.loads(state_file.read_text())["phase"] == "stopped"
        finally:
            run.kill()
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 4 * BOUND_S))


def _status_pane(config: Path) -> str:
    import io

    from kimi_supervisor.cli.status import run_status

    out = io.StringIO()
    assert run_status(config, as_json=False, watch=False, out=out) == 0
    return out.getvalue()


def _front_doc(path: Path) -> dict[str, object]:
    """The `front` part of the front's state file ({} until it is written; it is replaced atomically)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    front = doc.get("front")
    return front if isinstance(front, dict) else {}


def _wait_notify(run: Run, key: str, value: str) -> object:
    import time

    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        found = run.notify.first(key, value)
        if found is not None:
            return found
        time.sleep(0.02)
    return None


@pytest.mark.parametrize(("load_s", "hold_s"), [(None, 120.0), (600.0, 630.0), (10.0, 60.0), (2000.0, 900.0)])
def test_without_front_hold_s_the_hold_is_the_engines_last_load_plus_30_s(
    tmp_path: Path, load_s: float | None, hold_s: float
) -> None:
    """docs/front.md, Holding: the engine's expected restart from its own history, at least 60 s, at most 900 s;
    120 s without a history.  front.hold_s, when given, wins."""
    from kimi_supervisor.deployment.front.proxy import FrontServer
    from kimi_supervisor.opsview.history import HistoryData, RunRecord, dump_history
    from testkit.fakes.log import RecordingLog

    cfg = load_config(_front_config(tmp_path, 8000))
    assert cfg.front is not None and cfg.front.hold_s is None
    history = cfg.front.engine_history_file
    assert history == tmp_path / "state" / "kimi-a" / "history.json"
    if load_s is not None:
        history.parent.mkdir(parents=True)
        history.write_bytes(dump_history(HistoryData([RunRecord(start=0.0, pid=1, ready=1.0, load_s=load_s)])))
    assert FrontServer(cfg.front, RecordingLog()).gate.hold_s == hold_s
    given = load_config(_front_config(tmp_path, 8000, hold_s=45))
    assert given.front is not None and FrontServer(given.front, RecordingLog()).gate.hold_s == 45.0


@pytest.mark.parametrize(
    ("example", "services"),
    [
        ("front", "kimi-supervisor@kimi.service kimi-supervisor-front@kimi.service"),
        (
            "weights-front",
            "kimi-supervisor-weights@kimi.service kimi-supervisor@kimi.service kimi-supervisor-front@kimi.service",
        ),
    ],
)
def test_the_example_front_deployments_load_agree_and_install_in_one_command(
    tmp_path: Path, example: str, services: str
) -> None:
    """etc/front/ (engine + front) and etc/weights-front/ (engine + holder + front): the engine written for its front
    (--uds on the front's socket, --enable-scale-out), the front named by its file, and one install-unit for all."""
    from tests.cli.test_entry import cli

    etc = Path(__file__).resolve().parents[3] / "etc" / example
    engine, front = load_config(etc / "kimi.toml"), load_config(etc / "kimi.front.toml")
    assert (front.role, front.deployment.name, engine.deployment.name) == (Role.FRONT, "kimi", "kimi")
    role = for_config(front)
    assert isinstance(role, Front) and role.missing_flags(engine) == []
    units = tmp_path / "units"
    done = cli(
        "install-unit",
        "--instance",
        "kimi",
        "--config",
        str(etc / "kimi.toml"),
        "--unit-dir",
        str(units),
        "--no-reload",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"; now: systemctl enable --now {services}\n")


def test_the_http_stack_the_front_names_is_pyprojects_dependency() -> None:
    """One requirement: what the dry run's install line says is what `pip install .` installs (docs/front.md)."""
    from kimi_supervisor.config.load import tomllib  # tomli before Python 3.11
    from kimi_supervisor.deployment.front.role import HTTP_STACK

    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    assert HTTP_STACK in pyproject["project"]["dependencies"]
    assert "front" not in pyproject["project"]["optional-dependencies"]  # no extra of the same name to forget
