"""Who the front runs as (docs/front.md, "Who it runs as"): the real CLI started as root takes its locks and its
port, makes its directories for its account, then serves as that account (`front.user`, else its engine's
`child.user`) with no group of root's left; the engine's socket is that account's alone, so a third account cannot
connect; a front account that is not the engine child's, and an engine config without the flags the front needs,
are refused at the start (exit 78), one line naming the file."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kimi_supervisor.child.engine_socket import prepare_engine_socket
from kimi_supervisor.child.spawnplan import resolve_identity
from kimi_supervisor.config.front import engine_socket
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import ExitCode
from testkit.fakes.log import RecordingLog
from testkit.harness import Run, write_config
from testkit.procutil import free_port
from tests.deployment.front.fake_engine import FakeEngine
from tests.deployment.front.harness import BOUND_S, until
from tests.deployment.front.test_front_role import _wait_notify

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another account needs root")

NAME = "kimi-a"
# A uid and gid no account of this host has: the "third account" (no account is created on the host).
STRANGER = 64999


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every account may traverse (pytest's tmp_path is root's 0700): the front, once it is
    `nobody`, reads its engine's files and reaches its socket below it."""
    path = Path(tempfile.mkdtemp(prefix="kimi-front-account-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _configs(base: Path, port: int, front_user: str | None, child_user: str | None, argv_extra: list[str]) -> Path:
    paths = {"runtime_directory": str(base / "run"), "state_directory": str(base / "state")}
    front = {"host": "127.0.0.1", "port": port, **({"user": front_user} if front_user else {})}
    config = write_config(
        base / f"{NAME}.front.toml", {"deployment": {"name": NAME, "role": "front"}, "front": front, "paths": paths}
    )
    sock = engine_socket(base / "run", NAME)
    child: dict[str, object] = {"argv": ["vllm", "serve", "/m", *argv_extra]}
    if child_user:
        child["user"] = child_user
    write_config(base / f"{NAME}.toml", {"deployment": {"name": NAME}, "child": child, "paths": paths})
    assert str(sock) in argv_extra or "--uds" not in argv_extra
    return config


def _ids(pid: int) -> dict[str, list[int]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        key: [int(v) for v in line.split(":", 1)[1].split()]
        for line in lines
        for key in ("Uid", "Gid", "Groups")
        if line.startswith(key + ":")
    }


def _connect_as(uid: int, gid: int, sock: Path) -> str:
    """What a process of `uid`/`gid` (no other group) gets when it connects to `sock`."""
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print(type(e).__name__)\n"
        "else:\n    print('connected')\n"
    )
    # The system's interpreter: this one may live in root's 0700 home, which the other account cannot enter.
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no python3 in /usr/bin or /bin for another account to run")
    done = subprocess.run(
        [python, "-c", probe, str(sock)],
        user=uid,
        group=gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize("given", ["front.user", "engine child.user"])
def test_the_front_serves_as_its_account_and_a_third_account_cannot_reach_the_engine(base: Path, given: str) -> None:
    nobody = pwd.getpwnam("nobody")
    port = free_port()
    sock = engine_socket(base / "run", NAME)
    flags = ["--uds", str(sock), "--enable-scale-out"]
    front_user = "nobody" if given == "front.user" else None
    config = _configs(base, port, front_user, "nobody", flags)
    # The engine's side, as its supervisor does it for child.user (child/engine_socket.py), and a stand-in vLLM
    # bound there as that account would be under the unit's UMask=0077.
    (base / "run" / NAME).mkdir(parents=True)
    prepare_engine_socket(sock, base / "run" / NAME, resolve_identity("nobody", None), RecordingLog())
    engine = FakeEngine(sock)

    async def scenario() -> None:
        await engine.start()
        os.chown(sock, nobody.pw_uid, nobody.pw_gid)
        os.chmod(sock, 0o700)
        run = Run(config, base, notify_mode=0o777)
        try:
            dropped = await asyncio.to_thread(run.wait_event, "front.dropped", BOUND_S)
            assert (dropped["user"], dropped["uid"]) == ("nobody", nobody.pw_uid)
            assert await asyncio.to_thread(_wait_notify, run, "READY", "1") is not None
            ids = _ids(run.proc.pid)
            assert ids["Uid"] == [nobody.pw_uid] * 4 and ids["Gid"] == [nobody.pw_gid] * 4
            assert 0 not in ids["Groups"]
            # It reaches the engine as that account, and its state file is in a directory of its own.
            async with (
                aiohttp.ClientSession() as client,
                client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as a,
            ):
                assert a.status == 200
            state = base / "run" / NAME / "front-state" / "state.front.json"
            await until(state.exists, "the front's state file")
            assert state.stat().st_uid == nobody.pw_uid
            directory = sock.parent.stat()
            assert (directory.st_uid, stat.S_IMODE(directory.st_mode)) == (nobody.pw_uid, 0o700)
            # A third account: neither the engine's child nor the front.
            assert await asyncio.to_thread(_connect_as, STRANGER, STRANGER, sock) == "PermissionError"
            assert await asyncio.to_thread(_connect_as, nobody.pw_uid, nobody.pw_gid, sock) == "connected"
            run.signal(signal.SIGTERM)
            assert await asyncio.to_thread(run.wait, BOUND_S) == 0, (run.events[-5:], run.raw_stderr[-10:])
        finally:
            run.kill()
            await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 4 * BOUND_S))


@pytest.mark.parametrize(
    ("front_user", "child_user", "flags", "message"),
    [
        (
            "nobody",
            None,
            ["--uds", "{sock}", "--enable-scale-out"],
            "{front}: front.user: 'nobody' cannot reach the engine's socket, which is {engine}'s child account's "
            "alone ('root'): make them the same",
        ),
        (
            None,
            "nobody",
            ["--enable-scale-out"],
            "{engine}: child.argv lacks --uds {sock}, which its front needs (docs/front.md)",
        ),
        (
            None,
            "nobody",
            ["--uds", "{sock}"],
            "{engine}: child.argv lacks --enable-scale-out (a broken stream's resume needs /inference/v1/generate), "
            "which its front needs (docs/front.md)",
        ),
    ],
)
def test_a_front_its_engine_cannot_serve_is_refused_at_the_start(
    base: Path, front_user: str | None, child_user: str | None, flags: list[str], message: str
) -> None:
    sock = engine_socket(base / "run", NAME)
    argv = [f.format(sock=sock) for f in flags]
    config = _configs(base, free_port(), front_user, child_user, argv)
    run = Run(config, base)
    try:
        assert run.wait(BOUND_S) == int(ExitCode.CONFIG)
    finally:
        run.kill()
    text = message.format(front=config, engine=base / f"{NAME}.toml", sock=sock)
    assert run.raw_stderr == [f"kimi-supervisor: config error: {text}"]


def test_a_front_user_this_host_does_not_have_is_a_config_error(base: Path) -> None:
    config = _configs(base, 8000, "no-such-account-kimi", None, [])
    with pytest.raises(Exception) as err:
        load_config(config)
    assert getattr(err.value, "exit_code", None) == ExitCode.CONFIG
    assert str(err.value) == f"{config}: front.user: no such user 'no-such-account-kimi' on this host"
