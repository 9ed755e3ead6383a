"""Who may be reaped: vLLM's entry points only, root/child.user only, never a live supervisor's tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kimi_supervisor.clock import SystemClock
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.host.gpu import GpuProcess
from kimi_supervisor.host.instance_lock import lock_owners
from kimi_supervisor.host.proctable import ProcInfo, PsutilProcessTable
from kimi_supervisor.preflight.reaper import KillRules, execute_reap, plan_reap
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog
from tests.conftest import REPO, ProcSpawner, wait_for
from tests.preflight.test_preflight import make_cfg, run

TABLE = PsutilProcessTable()
# `exec -a NAME python` makes Python look for its library next to NAME on PATH: point it home.
AS_NAMED = {**os.environ, "PYTHONHOME": sys.base_prefix}
ROOT = os.geteuid() == 0


def reap_cfg(child_user: str | None = None, **reap: object):  # type: ignore[no-untyped-def]
    child: dict[str, object] = {"argv": ["vllm", "serve", "/m"]}
    if child_user:
        child["user"] = child_user
    return parse_config({"child": child, "preflight": {"reap": reap}}, Path("t.toml")).preflight.reap


def proc(*argv: str, name: str | None = None, pid: int = 5_000_001) -> ProcInfo:
    return ProcInfo(pid, 1, name or os.path.basename(argv[0])[:15], tuple(argv), 0, pid, 1.0)


# docs/kill-safety.md's "Kill rules" examples, verbatim.
MATCH = [
    ("vllm", "serve", "/models/kimi", "--tensor-parallel-size", "8"),
    ("/root/ml-env/bin/vllm", "serve", "/m"),
    ("/root/ml-env/bin/python3", "/root/ml-env/bin/vllm", "serve", "/m"),
    ("/root/ml-env/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "/m"),
    ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"),
    ("python3.12", "-u", "-X", "faulthandler", "-m", "vllm.entrypoints.openai.api_server"),
    ("VLLM::EngineCore",),
    ("VLLM::Worker_TP3",),
]
NO_MATCH = [
    ("python3", "eval.py", "--output-dir", "/data/vllm-eval"),
    ("python3", "train.py", "--out", "/data/vllm"),
    ("python3", "-c", "import vllm; print(vllm.__version__)"),
    ("python3", "-m", "vllm_eval.run"),
    ("vllm", "bench", "throughput"),
    ("runuser", "-u", "vllm", "--", "vllm", "serve", "/m"),
    ("sudo", "-u", "vllm", "/opt/venv/bin/python3", "-m", "vllm.entrypoints.openai.api_server"),
    ("bash", "-c", "vllm serve /m"),
    ("tmux", "new-session", "-d", "/root/ml-env/bin/vllm serve /m"),
    ("/usr/bin/sh", "-c", "exec python3 -m vllm.entrypoints.openai.api_server"),
]


@pytest.mark.parametrize("argv", MATCH)
def test_default_rules_match_vllm_entry_points(argv: tuple[str, ...]) -> None:
    assert KillRules(reap_cfg()).matches(proc(*argv))


@pytest.mark.parametrize("argv", NO_MATCH)
def test_default_rules_do_not_match_a_mere_vllm_argument_or_a_wrapper(argv: tuple[str, ...]) -> None:
    assert not KillRules(reap_cfg()).matches(proc(*argv))


WRAPPERS = ["runuser", "sudo", "tmux", "bash", "sh", "screen", "nohup", "su", "setsid", "/usr/bin/env"]
WORDS = st.sampled_from(
    ["vllm", "serve", "-m", "vllm.entrypoints.openai.api_server", "/data/vllm-eval", "python3", "-c", "--x", "/m"]
)


@given(wrapper=st.sampled_from(WRAPPERS), rest=st.lists(WORDS | st.text(min_size=1, max_size=12), max_size=8))
def test_no_wrapper_matches_whatever_its_arguments_say(wrapper: str, rest: list[str]) -> None:
    assert not KillRules(reap_cfg()).matches(proc(wrapper, *rest))


@given(
    script=st.from_regex(r"[a-z_]{1,10}\.py", fullmatch=True),
    rest=st.lists(WORDS | st.text(min_size=1, max_size=12), max_size=8),
)
def test_a_python_script_is_never_vllm_whatever_its_arguments(script: str, rest: list[str]) -> None:
    assert not KillRules(reap_cfg()).matches(proc("python3", script, *rest))


MP_CHILD = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'from multiprocessing.spawn import spawn_main; import time; "
    "time.sleep(600)', '--multiprocessing-fork'])\n"
)


def test_multiprocessing_children_match_through_their_vllm_ancestor(spawner: ProcSpawner) -> None:
    # The same spawn child (before vLLM retitles it) under a vLLM entry point and under someone's eval job.
    server = spawner.module("vllm.entrypoints.openai.api_server", code=MP_CHILD)
    evaluation = spawner.start([sys.executable, "-c", MP_CHILD + "import time; time.sleep(600)", "eval.py", "vllm"])
    rules = KillRules(reap_cfg())
    for parent, expected in ((server, True), (evaluation, False)):
        found = wait_for(lambda p=parent: [c for c in TABLE.all() if c.ppid == p.pid])  # type: ignore[misc]
        child = found[0]  # type: ignore[index]
        assert "multiprocessing.spawn" in child.command and not rules.matches(child)
        assert rules.matches_in_tree(child, TABLE) is expected


def test_a_wrapper_is_never_planned_as_parent(tmp_path: Path, spawner: ProcSpawner) -> None:
    # runuser-like root wrapper whose argv spells a vLLM command line; its child is the stale worker.
    worker_code = (
        "import ctypes, time\nctypes.CDLL(None).prctl(15, b'VLLM::Worker_TP0', 0, 0, 0)\n"
        "print('up', flush=True)\ntime.sleep(600)\n"
    )
    wrapper_code = (
        "import subprocess, sys, time\n"
        f"w = subprocess.Popen([{sys.executable!r}, '-c', {worker_code!r}], stdout=subprocess.PIPE)\n"
        "print(w.pid, flush=True)\nw.stdout.readline()\nprint('up', flush=True)\ntime.sleep(600)\n"
    )
    wrapper = spawner.start(
        [
            "bash",
            "-c",
            f'exec -a runuser {sys.executable} -c "$0" "$@"',
            wrapper_code,
            "-u",
            "vllm",
            "--",
            "/opt/venv/bin/python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
        ],
        env=AS_NAMED,
    )
    assert wrapper.stdout is not None
    worker_pid = int(wrapper.stdout.readline())
    assert wrapper.stdout.readline() == b"up\n"
    assert TABLE.get(wrapper.pid).cmdline[0] == "runuser"  # type: ignore[union-attr]
    probe = FakeGpuProbe([FakeGpu(occupants={worker_pid: 30_000})])
    log = RecordingLog()
    dry = run(make_cfg(tmp_path, tp=1), probe, dry=True)
    killed = [c.data["pid"] for c in dry.checks if c.verdict.value == "would kill"]
    assert killed == [worker_pid]
    report = run(make_cfg(tmp_path, tp=1), probe, dry=False, log=log, clock=SystemClock())
    assert report.proceed
    assert [k["pid"] for k in log.events("preflight.kill")] == [worker_pid]
    assert wrapper.poll() is None


def test_small_holder_outside_the_rules_does_not_fail_the_dry_run(tmp_path: Path, spawner: ProcSpawner) -> None:
    worker = spawner.sleeper(title="VLLM::Worker_TP0")
    agent = spawner.sleeper(title="dcgm-agent")  # a monitoring agent's 300 MiB context
    probe = FakeGpuProbe([FakeGpu(occupants={worker.pid: 40_000, agent.pid: 300})])
    dry = run(make_cfg(tmp_path, tp=1), probe, dry=True)
    wait = next(c for c in dry.checks if c.name == "gpu_wait")
    assert (wait.verdict.value, wait.message) == ("ok", "1 busy GPU(s) would be freed by reaping")
    assert dry.proceed
    real = run(make_cfg(tmp_path, tp=1), probe, dry=False, clock=SystemClock())
    assert real.proceed and agent.poll() is None and worker.wait(5) < 0


def test_live_supervisor_trees_are_never_victims(tmp_path: Path, spawner: ProcSpawner) -> None:
    # (a) a process whose argv is kimi-supervisor's, (b) a process holding an instance lock;
    # each with a child that matches every rule and holds a GPU.
    # exec -a changes argv[0], and with it Python's idea of sys.executable: name the interpreter.
    child = f"import subprocess, time\nsubprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(600)'])\n"
    named_code = (
        child.replace(
            "'import time;", '\'import ctypes; ctypes.CDLL(None).prctl(15, b"VLLM::Worker_TP0",0,0,0); import time;'
        )
        + "print('up', flush=True)\ntime.sleep(600)\n"
    )
    by_argv = spawner.start(
        ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config x', named_code], env=AS_NAMED
    )
    run_dir = tmp_path / "run"
    lock_code = (
        "from pathlib import Path\nfrom kimi_supervisor.host import instance_lock\n"
        f"lock = instance_lock.acquire(instance_lock.Resources(Path({str(run_dir)!r}), (0,), 8555), 'x')\n" + named_code
    )
    # Only a root kimi-supervisor's lock counts: the holder has kimi-supervisor's argv too.
    by_lock = spawner.start(
        ["bash", "-c", f'exec -a kimi-supervisor {sys.executable} -c "$0" --config y', lock_code],
        env={**AS_NAMED, "PYTHONPATH": str(REPO)},
    )
    for p in (by_argv, by_lock):
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
    kids = {p.pid: wait_for(lambda p=p: [c for c in TABLE.all() if c.ppid == p.pid])[0] for p in (by_argv, by_lock)}  # type: ignore[index,misc]
    occupants = [GpuProcess(k.pid, 0, 1000) for k in kids.values()]  # type: ignore[attr-defined]
    plan = plan_reap(occupants, TABLE, reap_cfg(), os.getpid(), lock_owners(run_dir))
    assert plan.victims == ()
    reasons = {s.pid: s.reason for s in plan.spared}
    assert reasons[kids[by_argv.pid].pid] == f"descends from a live kimi-supervisor (PID {by_argv.pid})"  # type: ignore[attr-defined]
    assert reasons[kids[by_lock.pid].pid] == f"descends from a live kimi-supervisor (PID {by_lock.pid})"  # type: ignore[attr-defined]
    # Once the lock holder dies its (now orphaned) child is stale: it may go.
    by_lock.kill()
    by_lock.wait()
    orphan = kids[by_lock.pid].pid  # type: ignore[attr-defined]
    wait_for(lambda: [v.proc.pid for v in plan_reap(occupants, TABLE, reap_cfg(), os.getpid()).victims] == [orphan])


@pytest.mark.skipif(not ROOT, reason="another user's process needs root")
def test_nobodys_lock_holder_or_supervisor_lookalike_shields_nothing(open_dir: Path, spawner: ProcSpawner) -> None:
    """vLLM runs as child.user = nobody, so nobody's stale workers may be reaped: a nobody process flocking a lock
    file (a read-only descriptor is enough) or named kimi-supervisor must not make its GPU occupants untouchable."""
    lock = open_dir / "gpu-0.lock"
    lock.write_text("{}")
    lock.chmod(0o644)  # as earlier versions left it
    title = 'import ctypes; ctypes.CDLL(None).prctl(15, b"VLLM::Worker_TP0", 0, 0, 0); import time; time.sleep(600)'
    worker = f"import subprocess, time\nsubprocess.Popen(['/usr/bin/python3', '-c', {title!r}])\n"
    flocker = spawner.python(
        f"import fcntl, os\nfd = os.open({str(lock)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        + worker
        + "print('up', flush=True)\ntime.sleep(600)\n",
        uid=65534,
    )
    lookalike = spawner.start(
        [
            "bash",
            "-c",
            'exec -a kimi-supervisor /usr/bin/python3 -c "$0" --config x',
            worker + "print('up', flush=True)\ntime.sleep(600)\n",
        ],
        uid=65534,
    )
    for p in (flocker, lookalike):
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
    assert lock_owners(open_dir) == set()
    kids = [
        wait_for(lambda p=p: [c for c in TABLE.all() if c.ppid == p.pid and c.name.startswith("VLLM")])[0]
        for p in (flocker, lookalike)
    ]  # type: ignore[index,misc]
    occupants = [GpuProcess(k.pid, 0, 1000) for k in kids]  # type: ignore[attr-defined]
    plan = plan_reap(occupants, TABLE, reap_cfg("nobody"), os.getpid(), lock_owners(open_dir))
    assert sorted(v.proc.pid for v in plan.victims) == sorted(k.pid for k in kids), plan.spared  # type: ignore[attr-defined]


class CgroupTable(PsutilProcessTable):
    """The real table with cgroups as systemd would place them."""

    def __init__(self, cgroups: dict[int, str]) -> None:
        super().__init__()
        self.cgroups = cgroups

    def cgroup(self, pid: int) -> str | None:
        return self.cgroups.get(pid, "/user.slice/user-0.slice/session-1.scope")


def test_a_live_units_cgroup_is_never_reaped(tmp_path: Path, spawner: ProcSpawner) -> None:
    supervisor = spawner.sleeper(extra_args=["--unit-main"])
    detached = spawner.sleeper(title="VLLM::Worker_TP0")  # double-forked away, still in the unit's cgroup
    stale = spawner.sleeper(title="VLLM::Worker_TP1")  # in our own unit's cgroup: ours to clean up
    unit = "/system.slice/kimi-supervisor@b.service"
    table = CgroupTable(
        {supervisor.pid: unit, detached.pid: unit + "/payload", stale.pid: "/system.slice/kimi-supervisor@a.service"}
    )
    occupants = [GpuProcess(detached.pid, 0, 1000), GpuProcess(stale.pid, 0, 1000)]
    plan = plan_reap(occupants, table, reap_cfg(), os.getpid(), [supervisor.pid])
    assert [v.proc.pid for v in plan.victims] == [stale.pid]
    assert plan.spared[0].reason == (
        f"runs in kimi-supervisor@b.service, the cgroup of a live kimi-supervisor (PID {supervisor.pid})"
    )


@pytest.mark.skipif(not ROOT, reason="another user's process needs root")
def test_owner_guard_follows_child_user(spawner: ProcSpawner) -> None:
    worker = spawner.sleeper(title="VLLM::Worker_TP0", uid=65534)
    occupants = [GpuProcess(worker.pid, 0, 1000)]
    assert plan_reap(occupants, TABLE, reap_cfg(), os.getpid()).victims == ()
    assert [v.proc.pid for v in plan_reap(occupants, TABLE, reap_cfg("nobody"), os.getpid()).victims] == [worker.pid]
    plan = plan_reap(occupants, TABLE, reap_cfg(users=["65534"]), os.getpid())
    outcome = execute_reap(plan, TABLE, SystemClock(), 2.0, lambda v, s: None)
    assert [p.pid for p in outcome.terminated] == [worker.pid]


def test_owner_guard_spares_with_the_owner_named(spawner: ProcSpawner) -> None:
    worker = spawner.sleeper(title="VLLM::Worker_TP0")
    plan = plan_reap([GpuProcess(worker.pid, 0, 1000)], TABLE, reap_cfg(users=["nobody"]), os.getpid())
    assert plan.spared[0].reason == "owned by user root, not one of preflight.reap.users ['nobody']"
