"""The dry run tells the truth: for generated scenes, its verdict and would-kill list are the real run's.

A scene is GPUs (base usage) and processes (kind, owner, parent, MiB per GPU) in a fake process
table whose signals "kill"; the fake probe's memory follows that table. The dry run and the real
run each see a fresh copy of the same scene.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kimi_supervisor.checks import Verdict
from kimi_supervisor.config.load import parse_config
from kimi_supervisor.exitcodes import PreflightError
from kimi_supervisor.host.procstate import ProcState
from kimi_supervisor.host.proctable import ProcInfo
from kimi_supervisor.preflight.run import Preflight
from testkit.fakes.clock import FakeClock
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe
from testkit.fakes.log import RecordingLog

SELF = 5_000_000  # the supervisor running the preflight
SUPERVISOR = 5_000_001  # another, live kimi-supervisor (its tree is not stale)
WRAPPER = 5_000_002  # root's runuser whose argv spells a vLLM command line
FIRST = 5_000_010
NOBODY = 65534

KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "worker": ("VLLM::Worker_TP", ("VLLM::Worker_TP0",)),
    "engine": ("VLLM::EngineCor", ("VLLM::EngineCore",)),
    "server": ("python3", ("/venv/bin/python3", "/venv/bin/vllm", "serve", "/m")),
    "module": ("python3", ("python3", "-m", "vllm.entrypoints.openai.api_server")),
    "eval": ("python3", ("python3", "eval.py", "--output-dir", "/data/vllm-eval")),
    "trainer": ("trainer", ("trainer", "--gpus", "1")),
    "agent": ("dcgm-exporter", ("dcgm-exporter",)),
    "spawned": ("python3", ("python3", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork")),
    "tracker": ("python3", ("python3", "-c", "from multiprocessing.resource_tracker import main")),
}


class SceneTable:
    """A ProcessTable over made-up processes; a signal ends one (SIGTERM unless it ignores it)."""

    def __init__(self, procs: list[ProcInfo], stubborn: set[int]) -> None:
        self.procs = {p.pid: p for p in procs}
        self.stubborn = stubborn
        self.dead: set[int] = set()
        self.signalled: list[tuple[int, str]] = []

    def get(self, pid: int) -> ProcInfo | None:
        return self.procs.get(pid) if pid not in self.dead else None

    def all(self) -> list[ProcInfo]:
        return [p for pid, p in self.procs.items() if pid not in self.dead]

    def descendants(self, pid: int) -> list[ProcInfo]:
        return []  # the preflight never asks: it looks up ancestors, not children

    def open_paths(self, prefixes: tuple[str, ...]) -> dict[str, set[int]]:
        return {}

    def alive(self, proc: ProcInfo) -> bool:
        return self.get(proc.pid) == proc

    def signal(self, proc: ProcInfo, sig: signal.Signals) -> bool:
        if not self.alive(proc):
            return False
        self.signalled.append((proc.pid, sig.name))
        if sig is signal.SIGKILL or proc.pid not in self.stubborn:
            self.dead.add(proc.pid)
        return True

    def cgroup(self, pid: int) -> str | None:
        return None

    def state(self, pid: int) -> ProcState | None:
        return None

    def is_alive(self, pid: int) -> bool:
        return pid in self.procs and pid not in self.dead


@dataclasses.dataclass(frozen=True)
class Scene:
    base_mib: tuple[int, ...]
    procs: tuple[tuple[str, int, int, tuple[int, ...], bool], ...]  # kind, uid, parent, MiB per GPU, stubborn


@st.composite
def scenes(draw: Any) -> Scene:
    gpus = draw(st.integers(1, 3))
    base = tuple(draw(st.lists(st.sampled_from([0, 0, 200, 900, 1500]), min_size=gpus, max_size=gpus)))
    procs = []
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(sorted(KINDS)))
        uid = draw(st.sampled_from([0, 0, NOBODY]))
        parent = draw(st.sampled_from([1, SUPERVISOR, WRAPPER] + [FIRST + j for j in range(i)]))
        mib = tuple(draw(st.lists(st.sampled_from([0, 0, 300, 800, 4000, 30000]), min_size=gpus, max_size=gpus)))
        procs.append((kind, uid, parent, mib, draw(st.booleans())))
    return Scene(base, tuple(procs))


def build(scene: Scene) -> tuple[SceneTable, FakeGpuProbe]:
    procs = [
        ProcInfo(SELF, 1, "kimi-supervisor", ("/usr/bin/python3", "/usr/local/bin/kimi-supervisor"), 0, SELF, 1.0),
        ProcInfo(SUPERVISOR, 1, "kimi-supervisor", ("kimi-supervisor", "--config", "/etc/b.toml"), 0, SUPERVISOR, 1.0),
        ProcInfo(
            WRAPPER, 1, "runuser", ("runuser", "-u", "vllm", "--", "/venv/bin/vllm", "serve", "/m"), 0, WRAPPER, 1.0
        ),
    ]
    sid = {SELF: SELF, SUPERVISOR: SUPERVISOR, WRAPPER: WRAPPER, 1: 0}
    stubborn = set()
    gpus = [FakeGpu(total_mib=80_000, base_used_mib=b) for b in scene.base_mib]
    for i, (kind, uid, parent, mib, ignores_term) in enumerate(scene.procs):
        pid = FIRST + i
        name, argv = KINDS[kind]
        # A child of init or of a wrapper leads its own session (vLLM's start_new_session); others inherit it.
        sid[pid] = pid if parent in (1, WRAPPER) else sid[parent]
        procs.append(ProcInfo(pid, parent, name, argv, uid, sid[pid], 1.0))
        if ignores_term:
            stubborn.add(pid)
        for gpu, held in zip(gpus, mib, strict=True):
            if held:
                gpu.occupants[pid] = held
    table = SceneTable(procs, stubborn)
    return table, FakeGpuProbe(gpus, alive=table.is_alive)


def config(tmp: Path, gpus: int) -> Any:
    argv = ["vllm", "serve", "/m", "--tensor-parallel-size", str(gpus), "--gpu-memory-utilization", "0.5"]
    return parse_config(
        {
            "child": {"argv": argv},
            "preflight": {
                "deadline_s": 5,
                "check_model": False,
                "check_port": False,
                "reap": {"grace_s": 1},
                "shm": {"enabled": False},
            },
            "paths": {"runtime_directory": str(tmp)},
        },
        tmp / "k.toml",
    )


# Found by this test (issue 52's runs): two resource trackers, outside the kill rules but holding 30000 MiB each,
# companions of a stale EngineCore: the real run killed all three and started; the dry run counted only the
# EngineCore's 300 MiB as freed and said --gpu-memory-utilization could not be met.
TRACKERS_HOLD_MEMORY = Scene(
    (0, 0),
    (
        ("tracker", 0, 1, (0, 30000), False),
        ("engine", 0, FIRST, (0, 300), False),
        ("tracker", 0, FIRST, (0, 30000), False),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scene=scenes())
@example(scene=TRACKERS_HOLD_MEMORY)
def test_dry_run_predicts_the_real_run(scene: Scene, tmp_path: Path) -> None:
    cfg = config(tmp_path, len(scene.base_mib))
    table, probe = build(scene)
    dry = Preflight(cfg, probe, table, FakeClock(), RecordingLog(), self_pid=SELF).run(dry_run=True)
    would_kill = {c.data["pid"] for c in dry.checks if c.verdict is Verdict.KILL}
    assert table.signalled == []

    table, probe = build(scene)
    try:
        Preflight(cfg, probe, table, FakeClock(), RecordingLog(), self_pid=SELF).run(dry_run=False)
        proceeded = True
    except PreflightError:
        proceeded = False
    killed = {pid for pid, _ in table.signalled}

    assert dry.proceed == proceeded, [(c.name, c.verdict.value, c.message) for c in dry.checks]
    assert would_kill == killed
    # And what is never killed, whatever the scene:
    procs = {p.pid: p for p in table.procs.values()}
    for pid in killed:
        assert procs[pid].uid == 0  # preflight.reap.users = root
        assert pid not in (SELF, SUPERVISOR, WRAPPER)
        parent = procs[pid].ppid
        while parent in procs:
            assert parent != SUPERVISOR  # a live supervisor's tree is not stale
            parent = procs[parent].ppid
