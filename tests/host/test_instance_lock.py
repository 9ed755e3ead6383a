"""One supervisor per GPU set: a second one refuses at once (exit 16) and changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli import entry as cli
from kimi_supervisor.config import layout
from kimi_supervisor.config.load import load_config
from kimi_supervisor.exitcodes import AnotherInstance, ExitCode, RuntimeDirectoryError
from kimi_supervisor.host import instance_lock
from kimi_supervisor.host.instance_lock import Resources
from kimi_supervisor.roles import Role
from testkit.fakes.gpu_cli import write_gpu_file
from testkit.fakes.log import RecordingLog
from testkit.harness import Run, fake_config, fake_tree_of
from tests.conftest import REPO, ProcSpawner, wait_for


def supervisor_entry(tmp_path: Path) -> list[str]:
    """testkit.fakes.gpu_cli run from a script named kimi-supervisor: a root process with kimi-supervisor's argv
    (`python3 .../kimi-supervisor ...`), as the unit's is; another command line's lock would not count."""
    script = tmp_path / "bin" / "kimi-supervisor"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import runpy\nrunpy.run_module('testkit.fakes.gpu_cli', run_name='__main__')\n")
    return [str(script)]


def hold_lock(directory: Path, gpus: list[int], port: int, options: str = "") -> subprocess.Popen[bytes]:
    """A real root process that looks like kimi-supervisor (its argv), takes the locks through the real code and
    then just holds them: only such a holder's lock counts.  `options`: Resources' keyword arguments, as code."""
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
        f"resources = instance_lock.Resources(Path({str(directory)!r}), tuple({gpus!r}), {port}{options})\n"
        "lock = instance_lock.acquire(resources, 'x.toml')\n"
        "print('locked', flush=True)\ntime.sleep(600)\n"
    )
    # exec -a changes argv[0], and with it Python's idea of sys.executable: PYTHONHOME names the installation.
    argv = ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config x.toml', code]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHOME": sys.base_prefix}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stdout.readline() == b"locked\n"
    return p


def test_a_sigkilled_owners_lock_never_blocks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run" / "kimi"  # missing: created, 0755
    owner = hold_lock(run_dir, [0, 1], 8123)
    try:
        assert (run_dir.stat().st_mode & 0o777) == 0o755
        with pytest.raises(AnotherInstance) as info:
            instance_lock.acquire(Resources(run_dir, (1, 2), 9000), "y.toml")
        assert info.value.message == (
            f"another kimi-supervisor (PID {owner.pid}) owns GPU 1, serving GPUs [0, 1], port 8123 "
            f"(lock {run_dir / 'gpu-1.lock'}); nothing was changed"
        )
        # Nothing of ours was left held: a disjoint set starts beside it.
        instance_lock.acquire(Resources(run_dir, (2, 3), 9001), "z.toml").close()
        assert instance_lock.lock_owners(run_dir) == {owner.pid}
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert (run_dir / "gpu-1.lock").exists()  # the stale file stays; the kernel dropped the lock
    lock = instance_lock.acquire(Resources(run_dir, (0, 1), 8123), "y.toml")
    try:
        assert json.loads((run_dir / "gpu-0.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.close()


def test_a_second_deployment_of_the_same_name_or_textfile_is_refused(tmp_path: Path) -> None:
    """Its state file, history (named after the deployment) or metrics textfile would be the first one's:
    refused like an overlapping GPU, on disjoint GPUs and ports too (docs/configuration.md)."""
    run_dir = tmp_path / "run"
    prom = tmp_path / "textfile" / "kimi.prom"
    owner = hold_lock(run_dir, [0], 8130, f", deployment='kimi-a', textfile=Path({str(prom)!r})")
    try:
        with pytest.raises(AnotherInstance) as info:
            instance_lock.acquire(Resources(run_dir, (1,), 8131, deployment="kimi-a"), "b.toml", RecordingLog())
        assert info.value.message == (
            f"another kimi-supervisor (PID {owner.pid}) owns deployment kimi-a, serving GPUs [0], port 8130 "
            f"(lock {run_dir / 'deployment-kimi-a.lock'}); nothing was changed"
        )
        with pytest.raises(AnotherInstance, match=rf"owns metrics textfile {prom}, serving GPUs \[0\], port 8130"):
            instance_lock.acquire(
                Resources(run_dir, (1,), 8131, deployment="kimi-b", textfile=prom), "b.toml", RecordingLog()
            )
        owner_seen = instance_lock.find_owner(Resources(run_dir, (1,), 8131, deployment="kimi-a"))
        assert owner_seen is not None and owner_seen.pid == owner.pid  # the dry run sees it too
        # Another name, another textfile, disjoint GPUs and port: side by side.
        other = tmp_path / "textfile" / "kimi-b.prom"
        instance_lock.acquire(
            Resources(run_dir, (1,), 8131, deployment="kimi-b", textfile=other), "b.toml", RecordingLog()
        ).close()
        assert instance_lock.find_owner(Resources(run_dir, (1,), 8131, deployment="kimi-b", textfile=other)) is None
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()


def test_lock_fds_are_not_inherited(tmp_path: Path) -> None:
    lock = instance_lock.acquire(Resources(tmp_path, (0,), 8124), "x.toml")
    try:
        child = subprocess.run(["ls", "-l", "/proc/self/fd/"], capture_output=True, text=True, close_fds=False)
        assert str(tmp_path) not in child.stdout
    finally:
        lock.close()


def test_dry_run_never_takes_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[Any] = []
    monkeypatch.setattr(instance_lock.fcntl, "flock", lambda *a: taken.append(a))
    config = fake_config(tmp_path, tp=1)
    rc = cli.main(["--config", str(config), "--dry-run", "--log-format", "json"])
    assert rc == ExitCode.OK and taken == []


def gpu_file(path: Path, occupants: dict[int, int], count: int = 1) -> Path:
    """`count` GPUs; holder i (in order) holds its MiB on GPU i % count."""
    gpus: list[dict[str, Any]] = [{"total_mib": 97887, "occupants": {}} for _ in range(count)]
    for i, (pid, mib) in enumerate(occupants.items()):
        gpus[i % count]["occupants"][str(pid)] = mib
    return write_gpu_file(path, gpus)  # replaced whole: the running supervisor's fake probe reads it any time


def test_gpu_file_is_replaced_whole_never_rewritten_in_place(tmp_path: Path) -> None:
    """A reader that opened the file before a rewrite reads the old document whole; one opened after, the new
    one.  In place (truncate, then write) the first would see the new bytes, or none at all."""
    path = gpu_file(tmp_path / "gpus.json", {}, count=2)
    with path.open() as before:
        gpu_file(path, {4242: 40_000}, count=2)
        assert json.load(before) == [{"total_mib": 97887, "occupants": {}}] * 2
    assert json.loads(path.read_text())[0]["occupants"] == {"4242": 40_000}


def test_second_supervisor_refuses_at_once_and_the_first_keeps_serving(tmp_path: Path) -> None:
    gpus = gpu_file(tmp_path / "gpus.json", {}, count=2)
    config = fake_config(tmp_path, tp=2, preflight={"gpus": [0, 1], "deadline_s": 3600})
    entry = [*supervisor_entry(tmp_path), str(gpus)]
    (tmp_path / "a").mkdir()
    first = Run(config, tmp_path / "a", entry=entry)
    second: Run | None = None
    try:
        first.wait_event("state.ready")
        first.wait_event("liveness.started")  # logged just after READY: not something the second one caused
        tree = wait_for(lambda: [p for p in fake_tree_of(str(tmp_path)) if p.name().startswith("VLLM::Worker")])
        workers = {p.pid: p.create_time() for p in tree}  # type: ignore[attr-defined]
        assert len(workers) == 2
        everyone = {p.pid: p.create_time() for p in fake_tree_of(str(tmp_path))}
        # Now the serving workers hold CUDA contexts on GPU 0 (as vLLM's do): they match every kill rule.
        gpu_file(gpus, dict.fromkeys(workers, 40_000), count=2)
        seen = len(first.events)

        # The same command again, from a shell, by mistake.
        (tmp_path / "b").mkdir()
        second = Run(config, tmp_path / "b", entry=entry)
        # "At once", by cause and not by this machine's speed: the preflight's deadline is an hour, so a
        # second supervisor that waited for the GPUs (or reaped its way in) would still be running when this
        # generous bound ends; one that refuses at the lock has exited long before.
        rc = second.wait(timeout=120)
        assert rc == ExitCode.ANOTHER_INSTANCE
        exit_event = second.event("supervisor.exit")
        assert exit_event is not None
        assert exit_event["error"].startswith(f"another kimi-supervisor (PID {first.proc.pid}) owns GPU 0, serving ")
        assert exit_event["error"].endswith("; nothing was changed")
        # One line, nothing else: no preflight, no state, no kill, nothing sent to systemd.
        assert second.names() == ["supervisor.exit"]
        assert second.notify.messages() == []

        # The first keeps serving: a /health probe of its, finished after the refusal, succeeded.
        refused_at = time.time()
        state = layout.of(load_config(config)).runtime / "state.json"

        def probed_since() -> bool:
            health = json.loads(state.read_text()).get("health") or {}
            return health.get("ok") is True and (health.get("at") or 0) > refused_at

        wait_for(probed_since, timeout=60)
        assert first.proc.poll() is None
        assert {p.pid: p.create_time() for p in fake_tree_of(str(tmp_path))} == everyone
        assert [e["event"] for e in first.events[seen:] if not e["event"].startswith("health")] == []
    finally:
        first.signal()
        assert first.wait() == 0
        if second is not None and second.proc.poll() is None:
            second.kill()


def test_dry_run_alongside_a_running_supervisor(tmp_path: Path) -> None:
    gpus = gpu_file(tmp_path / "gpus.json", {})
    config = fake_config(tmp_path, tp=1, preflight={"gpus": [0]})
    entry = [*supervisor_entry(tmp_path), str(gpus)]
    (tmp_path / "a").mkdir()
    first = Run(config, tmp_path / "a", entry=entry)
    try:
        first.wait_event("state.ready")
        worker = wait_for(lambda: [p for p in fake_tree_of(str(tmp_path)) if p.name().startswith("VLLM::Worker")])
        pid = worker[0].pid  # type: ignore[index]
        gpu_file(gpus, {pid: 40_000})
        dry = subprocess.run(
            [sys.executable, *entry, "--config", str(config), "--dry-run"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=30,
        )
        print(dry.stdout)
        assert dry.returncode == ExitCode.ANOTHER_INSTANCE, dry.stdout + dry.stderr
        port = json.loads((tmp_path / "run" / "gpu-0.lock").read_text())["port"]
        assert (
            f"instance            a kimi-supervisor (PID {first.proc.pid}) is running and owns GPUs [0], "
            f"port {port}; a start now would refuse (exit 16, GPU 0 is taken)"
        ) in dry.stdout
        # Its workers are not stale: never on the would-kill list, named with why.
        assert "would kill" not in dry.stdout
        assert f"PID {pid} (VLLM::Worker) 40000 MiB: not killed, descends from a live kimi-supervisor" in dry.stdout
        assert first.proc.poll() is None and worker[0].is_running()  # type: ignore[index]
    finally:
        first.signal()
        assert first.wait() == 0


# -- only a root kimi-supervisor's lock counts ------------------------------------------------------------


def flock_as_nobody(spawner: ProcSpawner, path: Path) -> subprocess.Popen[bytes]:
    """nobody opens the lock file read-only (all flock needs) and holds an exclusive flock on it."""
    code = (
        "import fcntl, os, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('up', flush=True)\ntime.sleep(600)\n"
    )
    p = spawner.python(code, uid=65534)
    assert p.stdout is not None and p.stdout.readline() == b"up\n", p.stderr.read() if p.stderr else ""
    return p


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root")
def test_a_lock_held_by_nobody_never_blocks_the_start(open_dir: Path, spawner: ProcSpawner) -> None:
    lock = open_dir / "gpu-0.lock"
    lock.write_text("{}")
    lock.chmod(0o644)  # what earlier versions created: readable by every user
    nobody = flock_as_nobody(spawner, lock)
    assert instance_lock.flock_lockers(lock) == {nobody.pid}
    assert instance_lock.lock_owners(open_dir) == set()  # no supervisor: nothing to shield in the reaper
    assert instance_lock.find_owner(Resources(open_dir, (0,), 8200)) is None  # the dry run does not refuse either
    log = RecordingLog()
    held = instance_lock.acquire(Resources(open_dir, (0,), 8200), "x.toml", log)
    try:
        [warning] = log.events("instance.foreign_lock")
        assert warning["lock"] == str(lock)
        assert warning["locker"].startswith(f"PID {nobody.pid} (uid 65534, ")
        assert warning["why"] == "not a kimi-supervisor run by root: not counted, the lock file was replaced"
        st = lock.stat()
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, 0, 0)
        assert instance_lock.flock_lockers(lock) == {os.getpid()}
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert nobody.poll() is None  # the stranger is left alone; its lock is on a file nobody sees now
        # nobody can no longer open the file at all.
        again = spawner.python(f"import os\nos.open({str(lock)!r}, os.O_RDONLY)", uid=65534)
        assert again.wait(10) != 0 and b"PermissionError" in (again.stderr.read() if again.stderr else b"")
    finally:
        held.close()
    assert sorted(p.name for p in open_dir.iterdir()) == [".replace.lock", "gpu-0.lock", "port-8200.lock"]


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's process needs root")
def test_a_root_supervisors_lock_still_refuses_beside_a_stranger(open_dir: Path, spawner: ProcSpawner) -> None:
    owner = hold_lock(open_dir, [0], 8201)
    try:
        with pytest.raises(AnotherInstance) as info:
            instance_lock.acquire(Resources(open_dir, (0,), 8201), "y.toml", RecordingLog())
        assert f"another kimi-supervisor (PID {owner.pid})" in info.value.message
        assert instance_lock.lock_owners(open_dir) == {owner.pid}
    finally:
        owner.kill()
        owner.wait()


def test_existing_lock_files_are_repaired_to_0600_and_root(open_dir: Path) -> None:
    lock = open_dir / "port-8202.lock"
    lock.write_text("")
    lock.chmod(0o666)
    os.chown(lock, 65534, 65534)
    instance_lock.acquire(Resources(open_dir, (), 8202), "x.toml", RecordingLog()).close()
    st = lock.stat()
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o600, 0, 0)
    fresh = open_dir / "gpu-3.lock"
    instance_lock.acquire(Resources(open_dir, (3,), 8203), "x.toml", RecordingLog()).close()
    assert fresh.stat().st_mode & 0o777 == 0o600


def test_a_link_or_a_fifo_at_a_lock_path_is_refused_and_left_alone(open_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    target.chmod(0o644)
    (open_dir / "gpu-0.lock").symlink_to(target)
    with pytest.raises(RuntimeDirectoryError, match=r"gpu-0\.lock"):
        instance_lock.acquire(Resources(open_dir, (0,), 8204), "x.toml", RecordingLog())
    assert target.read_text() == "keep me" and target.stat().st_mode & 0o777 == 0o644
    os.link(target, open_dir / "gpu-1.lock")
    with pytest.raises(RuntimeDirectoryError, match="hard link"):
        instance_lock.acquire(Resources(open_dir, (1,), 8204), "x.toml", RecordingLog())
    assert target.read_text() == "keep me" and target.stat().st_mode & 0o777 == 0o644
    os.mkfifo(open_dir / "gpu-2.lock")
    with pytest.raises(RuntimeDirectoryError, match="not a regular file"):
        instance_lock.acquire(Resources(open_dir, (2,), 8204), "x.toml", RecordingLog())


def test_one_holder_and_one_engine_of_one_deployment_share_gpus_and_nothing_else(tmp_path: Path) -> None:
    """docs/weight-holder.md: the holder takes its engine's GPUs under `.weights`; a second holder, a second engine,
    or either role of another deployment on those GPUs still refuses with 16."""
    run_dir = tmp_path / "run"
    weights = Role.WEIGHTS.file_suffix
    holder = hold_lock(run_dir, [0, 1], 8099, f", deployment='kimi', suffix={weights!r}")
    try:
        # The engine of the same deployment on the same GPUs: allowed.
        engine = instance_lock.acquire(Resources(run_dir, (0, 1), 8000, deployment="kimi"), "kimi.toml", RecordingLog())
        assert (run_dir / "gpu-0.weights.lock").exists() and (run_dir / "gpu-0.lock").exists()
        assert instance_lock.find_owner(Resources(run_dir, (0, 1), 8000, deployment="kimi")) is None
        engine.close()
        # A second holder of the same deployment: its own lock names are taken.
        with pytest.raises(AnotherInstance, match=r"owns GPU 0 \(weight holder\)"):
            instance_lock.acquire(
                Resources(run_dir, (0,), 8098, deployment="kimi", suffix=weights), "k2.toml", RecordingLog()
            )
        # An engine of another deployment on a holder's GPU: refused, and none of its locks left held.
        with pytest.raises(AnotherInstance) as info:
            instance_lock.acquire(Resources(run_dir, (1, 2), 8001, deployment="other"), "other.toml", RecordingLog())
        assert info.value.exit_code == ExitCode.ANOTHER_INSTANCE
        assert info.value.message == (
            f"another kimi-supervisor (PID {holder.pid}) of deployment 'kimi' owns GPU 1 (weight holder), serving "
            f"GPUs [0, 1], port 8099 (lock {run_dir / 'gpu-1.weights.lock'}); only a weight holder and the engine "
            "of one deployment (and its spare) share GPUs; nothing was changed"
        )
        assert instance_lock.flock_lockers(run_dir / "gpu-2.lock") == set()
        found = instance_lock.find_owner(
            Resources(run_dir, (1, 2), 8001, deployment="other")
        )  # the dry run says so too
        assert found is not None and found.pid == holder.pid
        instance_lock.acquire(Resources(run_dir, (2,), 8001, deployment="other"), "other.toml", RecordingLog()).close()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_holder_on_another_deployments_engine_gpus_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    engine = hold_lock(run_dir, [3], 8000, ", deployment='kimi-a'")
    try:
        weights = Role.WEIGHTS.file_suffix
        with pytest.raises(AnotherInstance, match=r"of deployment 'kimi-a' owns GPU 3, serving GPUs \[3\]"):
            instance_lock.acquire(
                Resources(run_dir, (3,), 8099, deployment="kimi-b", suffix=weights), "b.toml", RecordingLog()
            )
        assert instance_lock.flock_lockers(run_dir / "gpu-3.weights.lock") == set()
        instance_lock.acquire(
            Resources(run_dir, (3,), 8099, deployment="kimi-a", suffix=weights), "a.toml", RecordingLog()
        ).close()
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()


# Inside a PID namespace of the test's own: the lock's holder (this test, outside) is invisible, so /proc/locks
# lists no locker and the refusal can only go by the record in the file.  PID 1 there is this script.
FROM_ANOTHER_NAMESPACE = (
    "import sys\nfrom pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
    "try:\n"
    "    instance_lock.acquire(instance_lock.Resources(Path(sys.argv[1]), (0,), 8140), 'b.toml')\n"
    "except instance_lock.AnotherInstance as exc:\n"
    "    print(exc.message)\n"
)


def test_a_recorded_pid_that_names_another_process_now_is_not_named_as_the_owner(tmp_path: Path) -> None:
    """A supervisor that is PID 1 of its container records PID 1; where /proc/locks cannot show the locker (another
    PID namespace), the refusal went by that record and named PID 1 of this namespace, another process, and its
    unit. The record carries the writer's start time, and a PID whose process started at another time is
    "PID unknown"."""
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False).returncode != 0:
        pytest.skip("no PID namespaces here (unshare --pid failed)")
    run_dir = tmp_path / "run"
    lock = instance_lock.acquire(
        Resources(run_dir, (0,), 8139), "a.toml"
    )  # held by this process, outside the namespace
    try:
        record = json.loads((run_dir / "gpu-0.lock").read_text())
        assert record["pid"] == os.getpid()
        # What a supervisor that is its container's PID 1 writes: PID 1, and (now) its start time.
        (run_dir / "gpu-0.lock").write_text(json.dumps({**record, "pid": 1}) + "\n")
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", FROM_ANOTHER_NAMESPACE, str(run_dir)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60,
            check=False,
        )
    finally:
        lock.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("another kimi-supervisor (PID unknown) owns GPU 0, serving GPUs [0], port 8139"), (
        done.stdout
    )


def test_the_engine_its_holder_and_its_spare_share_gpus_and_a_spare_of_another_deployment_is_refused(
    tmp_path: Path,
) -> None:
    """docs/spare.md: the spare takes its engine's GPUs under `.spare`, beside the engine and the holder of the same
    deployment; a second spare, or a spare on another deployment's GPUs, refuses with 16."""
    run_dir = tmp_path / "run"
    weights, spare = Role.WEIGHTS.file_suffix, Role.SPARE.file_suffix
    holder = hold_lock(run_dir, [0, 1], 8099, f", deployment='kimi', suffix={weights!r}")
    engine = hold_lock(run_dir, [0, 1], 8000, ", deployment='kimi'")
    try:
        mine = Resources(run_dir, (0, 1), None, deployment="kimi", suffix=spare)
        assert instance_lock.find_owner(mine) is None  # beside the engine and the holder: free
        first = hold_lock(run_dir, [0, 1], None, f", deployment='kimi', suffix={spare!r}")  # type: ignore[arg-type]
        try:
            assert (run_dir / "gpu-0.spare.lock").exists()
            with pytest.raises(AnotherInstance, match=r"owns GPU 0 \(spare\)"):
                instance_lock.acquire(mine, "kimi.spare.toml", RecordingLog())
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        other = Resources(run_dir, (1,), None, deployment="other", suffix=spare)
        with pytest.raises(AnotherInstance, match=r"of deployment 'kimi' owns GPU 1"):
            instance_lock.acquire(other, "other.spare.toml", RecordingLog())
        assert instance_lock.flock_lockers(run_dir / "gpu-1.spare.lock") == set()
    finally:
        for p in (holder, engine):
            p.send_signal(signal.SIGKILL)
            p.wait()
