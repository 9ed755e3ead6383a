"""An incident's evidence, taken before a stop the supervisor decided on: the tree dies with the evidence in it.

When the supervisor judges vLLM wedged, hung or unhealthy, or its group lost a peer, it stops the tree, and
without this the operator learns *that* vLLM hung, never *where*.  So first, bounded in time:
  - every process of vLLM's tree's Python stacks (all threads), from py-spy's `dump` (pip `py-spy`, the
    `[forensics]` extra: a static binary that reads a live process's memory; found on PATH or beside
    sys.executable; `--nonblocking`: vLLM is never paused, and the unit needs no change).  In parallel, each
    under `PER_PROCESS_S`, all under `BUDGET_S`: a dump never delays the stop by more than that.  No py-spy,
    or its read refused, is one logged line and a note in the file, never a failure;
  - NVML's view of our GPUs: memory, utilisation, clocks, and the health counters whose pending remaps and
    uncorrected ECC errors say the device is at fault (host/gpu.py's GpuHealth);
  - the last /metrics sample the liveness thread took (requests running + waiting, and its age);
  - NCCL's RAS status where its service answers on the child's NCCL_RAS_ADDR (opsview/ncclras.py), asked
    beside the dumps under `RAS_S` (within `BUDGET_S`): no listener is one line in the file.
One JSON file per incident in `<state dir>/<deployment>/incidents/` (0700, root's), each 0600 and written
atomically (files/atomic.py); the oldest are removed past `KEEP` files or `MAX_TOTAL_BYTES`.  Its path goes
into the history record, `status NAME` and the failure's journal record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kimi_supervisor.config import layout
from kimi_supervisor.config.model import Config
from kimi_supervisor.files.atomic import ensure_directory, write_atomic
from kimi_supervisor.host.gpu import GpuProbe, GpuUnavailable
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview import ncclras

BUDGET_S = 4.0  # every dump together: what the stop may wait for the evidence
PER_PROCESS_S = 3.0  # one py-spy run
RAS_S = 3.0  # NCCL's RAS status, asked while the dumps run
RAS_SHARE = 0.8  # of the budget at most: its answer is in before the capture stops waiting for it
KEEP = 20
MAX_TOTAL_BYTES = 64 << 20
MAX_STACK_BYTES = 256 << 10  # a TP=8 tree of ~20 processes stays a few MiB
DIRECTORY = "incidents"
PREFIX = "incident-"


@dataclasses.dataclass(frozen=True)
class StackDump:
    pid: int
    name: str
    seconds: float | None  # how long its dump took; None: no answer within the budget
    text: str | None
    error: str | None


class Dumper(Protocol):
    """One process's Python stacks as text, or why not; returns within `timeout_s`."""

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]: ...


def find_pyspy() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtualenv's bin/ that PATH does not name)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


class PySpyDumper:
    """`py-spy dump --nonblocking`: reads the target's memory (process_vm_readv, which the unit's seccomp filter
    allows: it is in @ipc) without pausing it (ptrace, in @debug, which the filter refuses): docs/hardening.md."""

    def __init__(self, path: str) -> None:
        self.path = path

    def dump(self, pid: int, timeout_s: float) -> tuple[str | None, str | None]:
        try:
            proc = subprocess.Popen(
                [self.path, "dump", "--nonblocking", "--pid", str(pid)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            return None, f"py-spy could not run: {exc}"
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            abandon(proc)
            return None, f"py-spy gave no answer within {timeout_s:g}s"
        out = stdout.decode(errors="replace")[:MAX_STACK_BYTES]
        if proc.returncode != 0:
            # Its error and the causes under it ("Failed to suspend process", "EPERM: ..."), on one line.
            err = " ".join(w for w in (x.strip() for x in stderr.decode(errors="replace").splitlines()) if w)
            return (out or None), f"py-spy exited {proc.returncode}: {err or 'no message'}"[:500]
        return out, None


def abandon(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a helper past its time and leave it, never wait for it here.

    `subprocess.run` waits without a bound for the process it killed on a timeout: a py-spy in D state (reading
    a process stuck in the driver) never dies, so the dump, then the supervisor's exit, waited with it.  A daemon
    thread reaps it whenever it goes; the interpreter's exit does not wait for that thread."""
    with contextlib.suppress(OSError):
        proc.kill()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    threading.Thread(target=proc.wait, name=f"forensics-reap-{proc.pid}", daemon=True).start()


T = TypeVar("T")


def detached(calls: list[Callable[[], T]], workers: int, name: str) -> list[concurrent.futures.Future[T]]:
    """Each call in one of `workers` daemon threads; a future per call, in order.

    Not a ThreadPoolExecutor: the interpreter's exit joins its threads, so one dump that never returns kept the
    supervisor from exiting until systemd's own timeout.  A future still pending when its caller gives up is
    cancelled by it and never started."""
    futures: list[concurrent.futures.Future[T]] = [concurrent.futures.Future() for _ in calls]
    pending: queue.SimpleQueue[tuple[concurrent.futures.Future[T], Callable[[], T]]] = queue.SimpleQueue()
    for item in zip(futures, calls, strict=True):
        pending.put(item)

    def work() -> None:
        while True:
            try:
                future, call = pending.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # the caller reads it from the future
                future.set_exception(exc)

    for i in range(max(1, min(workers, len(calls)))):
        threading.Thread(target=work, name=f"{name}-{i}", daemon=True).start()
    return futures


def dump_stacks(
    procs: Iterable[tuple[int, str]], dumper: Dumper, budget_s: float = BUDGET_S, per_process_s: float = PER_PROCESS_S
) -> tuple[list[StackDump], float]:
    """Every process's dump, in parallel; what has not answered by `budget_s` is recorded as such, and left.

    Timed on the real monotonic clock, never a fake one: the waits are real threads and real processes."""
    clock = time.monotonic
    procs = list(procs)
    if not procs:
        return [], 0.0
    start = clock()

    def one(pid: int, name: str) -> StackDump:
        began = clock()
        text, error = dumper.dump(pid, min(per_process_s, budget_s))
        return StackDump(pid, name, round(clock() - began, 3), text, error)

    futures = detached([functools.partial(one, pid, name) for pid, name in procs], 16, "forensics")
    concurrent.futures.wait(futures, timeout=budget_s)
    for future in futures:
        future.cancel()  # those not started; a dumper that hangs is left behind, never waited for
    dumps = []
    for (pid, name), future in zip(procs, futures, strict=True):
        if future.done() and not future.cancelled() and future.exception() is None:
            dumps.append(future.result())
        else:
            dumps.append(StackDump(pid, name, None, None, f"no answer within the {budget_s:g}s budget"))
    return dumps, round(clock() - start, 3)


def gpu_view(probe: GpuProbe, gpus: tuple[int, ...]) -> list[dict[str, Any]]:
    view: list[dict[str, Any]] = []
    for index in gpus:
        entry: dict[str, Any] = {"index": index}
        for name, query in (("memory", probe.memory), ("activity", probe.activity), ("health", probe.health)):
            try:
                entry[name] = dataclasses.asdict(query(index))
            except GpuUnavailable as exc:
                entry[name] = {"error": str(exc)}
        try:
            entry["processes"] = [dataclasses.asdict(p) for p in probe.processes(index)]
        except GpuUnavailable as exc:
            entry["processes"] = {"error": str(exc)}
        view.append(entry)
    return view


@dataclasses.dataclass
class Incident:
    """What one capture found; `to_json` is the file's content."""

    at: float
    reason: str
    exit_code: int | None  # None: systemd's watchdog is about to end the run, not an exit of ours
    stacks: list[StackDump]
    stacks_s: float
    dumper: str | None  # py-spy's path, or why there was none
    gpus: list[dict[str, Any]]
    metrics: dict[str, Any] | None
    nccl_ras: dict[str, Any] | None = None  # ncclras.RasStatus; None: the child has no NCCL_RAS_ADDR
    seconds: float = 0.0

    def to_json(self) -> bytes:
        doc = dataclasses.asdict(self)
        doc["at_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return (json.dumps(doc, indent=1) + "\n").encode()


@dataclasses.dataclass(frozen=True)
class Scene:
    """What one capture looks at: the stop's reason and exit code (None: the watchdog's coming kill), the tree's
    members (PID, name), our GPUs, the last /metrics sample (its time on the loop's clock, running + waiting)
    and the child's NCCL_RAS_ADDR."""

    reason: str
    exit_code: int | None
    procs: list[tuple[int, str]]
    probe: GpuProbe
    gpus: tuple[int, ...]
    metrics: tuple[float, float] | None
    ras: tuple[str, int] | None = None


def capture(
    scene: Scene,
    dumper: Dumper | None,
    dumper_note: str,
    *,
    clock: Callable[[], float],
    wall: Callable[[], float],
    log: Logger,
    budget_s: float = BUDGET_S,
) -> Incident:
    """`clock`: the loop's monotonic clock, the one the metrics sample's time is on; `seconds` is real time, what
    the capture delays the stop by.  The RAS address is asked in a thread beside the dumps."""
    procs, ras, metrics = scene.procs, scene.ras, scene.metrics
    began, start = time.monotonic(), clock()
    asking = None
    if ras is not None:
        query = functools.partial(ncclras.query, ras[0], ras[1], min(RAS_S, RAS_SHARE * budget_s))
        [asking] = detached([query], 1, "forensics-ras")
    if dumper is None:
        stacks: list[StackDump] = []
        stacks_s = 0.0
        log.warning("incident.no_stacks", why=dumper_note)
    else:
        stacks, stacks_s = dump_stacks(procs, dumper, budget_s)
        refused = [d for d in stacks if d.error]
        if refused:
            # One line: a missing permission fails every dump the same way.
            log.warning("incident.stacks_missing", processes=len(refused), first=refused[0].error)
    sample = None if metrics is None else {"running_plus_waiting": metrics[1], "age_s": round(start - metrics[0], 3)}
    view = gpu_view(scene.probe, scene.gpus)
    incident = Incident(wall(), scene.reason, scene.exit_code, stacks, stacks_s, dumper_note, view, sample)
    if asking is not None and ras is not None:
        incident.nccl_ras = _ras_result(asking, began + budget_s, ras)
    incident.seconds = round(time.monotonic() - began, 3)
    return incident


def _ras_result(
    asking: concurrent.futures.Future[ncclras.RasStatus], deadline: float, ras: tuple[str, int]
) -> dict[str, Any]:
    """The query's answer, waited for no later than the capture's budget (the query bounds itself within it)."""
    try:
        status = asking.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
        return {"address": f"{ras[0]}:{ras[1]}", "text": None, "note": "no answer within the capture's budget"}
    return dataclasses.asdict(status)


def store_for(cfg: Config) -> IncidentStore:
    """Beside the deployment's history, in its state directory (config/layout.py)."""
    return IncidentStore(layout.of(cfg).state / DIRECTORY)


def default_dumper() -> tuple[Dumper | None, str]:
    """py-spy if this host has it, and what the incident file says about the dumper either way."""
    path = find_pyspy()
    if path is None:
        return None, f"py-spy not found on PATH or beside {sys.executable} (pip install 'kimi-supervisor[forensics]')"
    return PySpyDumper(path), path


def record(
    store: IncidentStore,
    scene: Scene,
    dumper: Callable[[], tuple[Dumper | None, str]],
    *,
    clock: Callable[[], float],
    wall: Callable[[], float],
    log: Logger,
    budget_s: float = BUDGET_S,
) -> str | None:
    """Capture and save one incident; its path, or None when it could not be written (logged, never raised)."""
    found, note = dumper()
    incident = capture(scene, found, note, clock=clock, wall=wall, log=log, budget_s=budget_s)
    try:
        path = store.save(incident)
    except OSError as exc:
        log.warning("incident.unwritable", directory=str(store.directory), error=str(exc), why="the stop goes on")
        return None
    dumped = sum(1 for d in incident.stacks if d.text)
    log.info(
        "incident.saved",
        path=str(path),
        stacks=f"{dumped}/{len(scene.procs)}",
        stacks_s=incident.stacks_s,
        nccl_ras=_ras_summary(incident.nccl_ras),
        seconds=incident.seconds,
    )
    return str(path)


def _ras_summary(found: dict[str, Any] | None) -> str:
    if found is None:
        return "no NCCL_RAS_ADDR"
    if found.get("text") and not found.get("note"):
        return f"report from {found['address']}"
    return str(found.get("note") or "")[:200]


class IncidentStore:
    """The incident files of one deployment: 0700 directory, 0600 files, the oldest rotated out."""

    def __init__(self, directory: Path, keep: int = KEEP, max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self.directory = directory
        self.keep = keep
        self.max_total_bytes = max_total_bytes

    def save(self, incident: Incident) -> Path:
        """The file written; OSError when the directory cannot be made or trusted (files/atomic.py)."""
        ensure_directory(self.directory.parent)
        with contextlib.suppress(FileExistsError):
            self.directory.mkdir(mode=0o700)
        # mkdir's mode passes the umask, and an older directory may be looser: tightened on the directory itself
        # (O_NOFOLLOW: a link planted at the name is refused), whose owner write_atomic then checks.
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(incident.at))
        cause = "watchdog" if incident.exit_code is None else incident.exit_code
        path = self.directory / f"{PREFIX}{stamp}-{int(incident.at * 1000) % 1000:03d}-{cause}.json"
        write_atomic(path, incident.to_json(), mode=0o600)
        self.rotate(keep_also=path)
        return path

    def files(self) -> list[Path]:
        return sorted(p for p in self.directory.glob(f"{PREFIX}*.json") if p.is_file() and not p.is_symlink())

    def rotate(self, keep_also: Path) -> None:
        """Oldest first, until at most `keep` files and `max_total_bytes` remain; the newest always stays."""
        files = self.files()
        sizes = {p: p.stat().st_size for p in files}
        total = sum(sizes.values())
        for p in list(files):
            if p == keep_also or (len(files) <= self.keep and total <= self.max_total_bytes):
                continue
            p.unlink(missing_ok=True)
            files.remove(p)
            total -= sizes[p]
