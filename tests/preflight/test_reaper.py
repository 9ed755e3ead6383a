"""Reaper: real victims die, real decoys live, every spare has a reason."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from kimi_supervisor.clock import SystemClock
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.host import procident
from kimi_supervisor.host.gpu import GpuProcess
from kimi_supervisor.host.procident import ProcIdent
from kimi_supervisor.host.proctable import ProcInfo, PsutilProcessTable
from kimi_supervisor.preflight.reaper import execute_reap, plan_reap
from testkit.fakes.gpu import INVISIBLE_PID
from tests.conftest import ProcSpawner, wait_for

TABLE = PsutilProcessTable()


class NotedTable(PsutilProcessTable):
    """The real table; each `alive` answer and each sleep of `NotedSleeps` noted in one list, in order."""

    def __init__(self, notes: list[tuple[str, int, bool]]) -> None:
        super().__init__()
        self.notes = notes

    def alive(self, proc: ProcInfo) -> bool:
        answer = super().alive(proc)
        self.notes.append(("alive", proc.pid, answer))
        return answer


class NotedSleeps(SystemClock):
    """The real clock (no fake time: the victims are real processes), each sleep noted."""

    def __init__(self, notes: list[tuple[str, int, bool]]) -> None:
        self.notes = notes

    def sleep(self, seconds: float) -> None:
        self.notes.append(("sleep", 0, True))
        super().sleep(seconds)


def reap_cfg(**reap: object):  # type: ignore[no-untyped-def]
    return parse_config(
        {"child": {"argv": ["vllm", "serve", "/m"]}, "preflight": {"reap": reap}}, Path("t.toml")
    ).preflight.reap


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_plan_kills_only_matching_gpu_occupants(spawner: ProcSpawner) -> None:
    worker = spawner.sleeper(title="VLLM::Worker_TP0")
    engine = spawner.sleeper(title="VLLM::EngineCore")
    trainer = spawner.sleeper(title="trainer")
    persistenced = spawner.sleeper(title="nvidia-persistenced")
    vllm_named_no_gpu = spawner.sleeper(title="VLLM::Worker_TP9")
    occupants = [
        GpuProcess(worker.pid, 0, 4000),
        GpuProcess(engine.pid, 1, 500),
        GpuProcess(trainer.pid, 1, 9000),
        GpuProcess(persistenced.pid, 0, 10),
        GpuProcess(os.getpid(), 0, 300),
        GpuProcess(INVISIBLE_PID, 1, 7000),
    ]
    plan = plan_reap(occupants, TABLE, reap_cfg(), os.getpid())

    assert {v.proc.pid for v in plan.victims} == {worker.pid, engine.pid}
    reasons = {s.pid: s.reason for s in plan.spared}
    assert reasons[trainer.pid] == "does not match preflight.reap.names / preflight.reap.cmdline"
    assert reasons[persistenced.pid] == "protected name 'nvidia-persiste'"  # comm keeps 15 chars
    assert reasons[os.getpid()] == "is the supervisor itself, one of its ancestors, or PID 1"
    assert reasons[INVISIBLE_PID].startswith(
        "NVML reports this PID but no such process is visible in this PID namespace"
    )
    assert vllm_named_no_gpu.pid not in reasons and vllm_named_no_gpu.pid not in {v.proc.pid for v in plan.victims}


def test_plan_matches_python_running_vllm_by_cmdline(spawner: ProcSpawner) -> None:
    server = spawner.module("vllm.entrypoints.openai.api_server")
    plan = plan_reap([GpuProcess(server.pid, 0, 100)], TABLE, reap_cfg(), os.getpid())
    assert [v.proc.pid for v in plan.victims] == [server.pid]


def test_disabled_reaping_spares_everyone(spawner: ProcSpawner) -> None:
    worker = spawner.sleeper(title="VLLM::Worker_TP0")
    plan = plan_reap([GpuProcess(worker.pid, 0, 4000)], TABLE, reap_cfg(enabled=False), os.getpid())
    assert plan.victims == ()
    assert plan.spared[0].reason == "reaping is disabled (preflight.reap.enabled = false)"


def test_ancestors_of_the_supervisor_are_never_victims(spawner: ProcSpawner) -> None:
    # Pretend our own parent (pytest's parent shell) holds a context and matches every rule.
    parent = os.getppid()
    plan = plan_reap([GpuProcess(parent, 0, 1000), GpuProcess(1, 0, 1000)], TABLE, reap_cfg(names=["*"]), os.getpid())
    assert plan.victims == ()


def test_execute_terms_then_kills_and_takes_companions(spawner: ProcSpawner) -> None:
    # A stale worker whose session also holds a resource_tracker, and one that ignores SIGTERM.
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
        "'from multiprocessing.resource_tracker import main'])\n"
        "print('up', flush=True)\ntime.sleep(600)\n"
    )
    worker = spawner.python(code, title="VLLM::Worker_TP0")
    assert worker.stdout is not None and worker.stdout.readline() == b"up\n"
    stubborn = spawner.python(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(600)",
        title="VLLM::Worker_TP1",
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"up\n"
    tracker = wait_for(
        lambda: [c for c in psutil.Process(worker.pid).children() if "resource_tracker" in " ".join(c.cmdline())]
    )
    tracker_pid = tracker[0].pid  # type: ignore[index]
    # Not our child: once reaped by init its PID is free again (pid_max can be 32768), so "gone" is checked by
    # identity, not by whoever holds the PID then.  worker and stubborn are our unreaped children: PIDs pinned.
    tracker_ident = ProcIdent(tracker_pid, tracker[0].create_time())  # type: ignore[index]
    foreign_tracker = spawner.sleeper(extra_args=["multiprocessing.resource_tracker"])  # another session: lives
    decoy = spawner.sleeper(title="VLLM::Worker_TP9")

    plan = plan_reap(
        [GpuProcess(worker.pid, 0, 4000), GpuProcess(stubborn.pid, 1, 4000)], TABLE, reap_cfg(), os.getpid()
    )
    whys = {v.proc.pid: v.why for v in plan.victims}
    assert whys == {
        worker.pid: "holds a CUDA context",
        stubborn.pid: "holds a CUDA context",
        tracker_pid: f"companion of PID {worker.pid}",
    }

    signalled: list[tuple[int, str]] = []
    notes: list[tuple[str, int, bool]] = []
    outcome = execute_reap(
        plan, NotedTable(notes), NotedSleeps(notes), 0.5, lambda v, s: signalled.append((v.proc.pid, s.name))
    )

    assert {p.pid for p in outcome.terminated} == {worker.pid, tracker_pid}
    assert [p.pid for p in outcome.killed] == [stubborn.pid]
    assert outcome.survivors == ()
    assert (stubborn.pid, "SIGKILL") in signalled and (worker.pid, "SIGTERM") in signalled
    assert not alive(worker.pid) and not alive(stubborn.pid) and not procident.alive(tracker_ident)
    assert alive(foreign_tracker.pid) and alive(decoy.pid)
    assert worker.wait(5) == -signal.SIGTERM
    # The waits end when the victims are gone, not at their deadlines (the SIGKILL wait's is 5 s): no sleep once the
    # stubborn one is seen dead.  By the calls, not by `outcome.seconds` (this machine's speed: bench row 1's).
    dead_at = notes.index(("alive", stubborn.pid, False))
    assert ("sleep", 0, True) not in notes[dead_at:], notes[dead_at:]


def test_recycled_pid_is_not_signalled(spawner: ProcSpawner) -> None:
    victim = spawner.sleeper(title="VLLM::Worker_TP0")
    plan = plan_reap([GpuProcess(victim.pid, 0, 1)], TABLE, reap_cfg(), os.getpid())
    info = plan.victims[0].proc
    forged = type(info)(**{**info.__dict__, "create_time": info.create_time - 100})
    assert TABLE.signal(forged, signal.SIGTERM) is False
    assert alive(victim.pid)
