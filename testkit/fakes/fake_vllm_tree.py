"""The fake vLLM's EngineCore and tensor-parallel workers: vLLM's process tree, its load and its deaths.

The APIServer (fake_vllm_api.py) forks EngineCore (title VLLM::EngineCore), which forks one worker per
rank (VLLM::Worker_TP<rank>, VLLM::Worker when TP=1). Each reports over a pipe: b"R" ready, b"F" failed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from typing import NoReturn

from testkit.fakes.fake_vllm_options import Config
from testkit.fakes.fake_vllm_output import excerpt, load_shards, replay, write_all
from testkit.fakes.fake_vllm_proc import (
    EXIT_LIFETIME,
    P,
    Stop,
    check,
    fork_child,
    install_term,
    pause,
    send,
    stop_children,
)

STARTUP = "startup.log"
FAILED = "startup_failed_engine.log"
WORKER_KILLED = "worker_killed.log"
SHUTDOWN = "shutdown.log"
# The captured engine failure's root cause; a failure mode prints its own in its place.
FIXTURE_ROOT_CAUSE = (
    "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: invalid header length"
)
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 512.50 MiB is free. Including non-PyTorch memory, this process has 139.29 GiB memory "
    "in use. Of the allocated memory 137.12 GiB is allocated by PyTorch, and 1.24 GiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


def free_memory_error(gpu_util: float, total_gib: float = 139.81) -> str:
    return (
        f"ValueError: Free memory on device (12.34/{total_gib:.2f} GiB) on startup is less than desired GPU memory "
        f"utilization ({gpu_util}, {gpu_util * total_gib:.2f} GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes."
    )


def lifetime_exit(children: list[int]) -> NoReturn:
    write_all(2, f"fake_vllm: {P.label} pid={P.pid}: --max-lifetime reached, exiting\n".encode())
    stop_children(children, graceful=False)
    os._exit(EXIT_LIFETIME)


def fork(cfg: Config, label: str, close_fds: list[int]) -> int:
    return fork_child(
        label,
        f"VLLM::{label}",
        close_fds=close_fds,
        orphan=cfg.orphan_workers,
        ignore_term=cfg.ignore_sigterm or cfg.ignore_sigterm_during_load,
    )


def _now_serving(cfg: Config) -> None:
    """Ready: signals are handled from now on (unless ignored for good)."""
    install_term(cfg.ignore_sigterm)
    if cfg.orphan_workers and not cfg.ignore_sigterm:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


# --------------------------------------------------------------------------------------------------
# worker


def worker_main(cfg: Config, rank: int, ready_w: int) -> NoReturn:
    if cfg.worker_setsid:
        with contextlib.suppress(OSError):
            os.setsid()
    try:
        _worker_load(cfg, rank, ready_w)
        _now_serving(cfg)
        while True:
            pause(3600.0, step=0.05)
    except Stop as stop:
        if stop.reason == "lifetime":
            lifetime_exit([])
        os._exit(0)


def _worker_load(cfg: Config, rank: int, ready_w: int) -> None:
    show = rank == 0  # as in vLLM, only the first rank draws the progress bar
    pause(0.1 * cfg.load_seconds)
    replay(excerpt(STARTUP, "Triton is installed", "Auto-prefetch is disabled", nth=2))
    if cfg.free_memory_error and rank == 0:
        _worker_fail(free_memory_error(cfg.gpu_util), ready_w)
    fail_at = max(1, cfg.shards // 2) if (cfg.crash_during_load and rank == 0) else None
    if not load_shards(cfg.shards, 0.7 * cfg.load_seconds, show=show, fail_at=fail_at, hold_until=cfg.hold_load_until):
        _worker_fail(OOM, ready_w)
    replay(excerpt(STARTUP, "Loading weights took", "Loading weights took"))
    pause(0.1 * cfg.load_seconds)
    send(ready_w, b"R")


def _worker_fail(root_cause: str, ready_w: int) -> NoReturn:
    # The real chain of a worker that failed to load, with this mode's root cause in its place.
    lines = excerpt(FAILED, "WorkerProc failed to start.", FIXTURE_ROOT_CAUSE, labels=("Worker",))
    replay(lines, {FIXTURE_ROOT_CAUSE: root_cause}, important=True)
    send(ready_w, b"F")
    os._exit(1)


# --------------------------------------------------------------------------------------------------
# engine core


def engine_main(cfg: Config, ready_w: int) -> NoReturn:
    workers: dict[int, int] = {}
    try:
        replay(excerpt(STARTUP, "Triton is installed", "reserved_cpus", nth=1))
        pipes: dict[int, int] = {}
        for rank in range(cfg.tp):
            r, w = os.pipe()
            pid = fork(cfg, f"Worker_TP{rank}" if cfg.tp > 1 else "Worker", [ready_w, r, *pipes])
            if pid == 0:
                worker_main(cfg, rank, w)
            os.close(w)
            workers[rank] = pid
            pipes[r] = rank
        _engine_wait_ready(workers, pipes, ready_w)
        _now_serving(cfg)
        _engine_serve(cfg, workers)
    except Stop as stop:
        kids = list(workers.values())
        if stop.reason == "lifetime":
            lifetime_exit(kids)
        if stop.reason == "signal":
            replay(
                excerpt(SHUTDOWN, "trigger received signal=SIGTERM", "waiting for worker exit", labels=("EngineCore",))
            )
        if not cfg.orphan_workers:
            stop_children(kids, graceful=stop.reason == "signal")
        os._exit(0)


def _engine_wait_ready(workers: dict[int, int], pipes: dict[int, int], ready_w: int) -> None:
    pending = dict(pipes)
    while pending:
        check()
        try:
            readable, _, _ = select.select(list(pending), [], [], 0.05)
        except InterruptedError:
            continue
        for fd in readable:
            data = os.read(fd, 64)
            if not data or b"F" in data:
                pause(0.05)  # a group-wide SIGTERM is not a failure
                _engine_fail(workers, ready_w)
            if b"R" in data:
                os.close(fd)
                del pending[fd]
    replay(excerpt(STARTUP, "Reducing Torch threads", "Enabled custom fusions", labels=("EngineCore",)))
    send(ready_w, b"R")
    os.close(ready_w)


def _engine_fail(workers: dict[int, int], ready_w: int) -> NoReturn:
    exc = "Exception: WorkerProc initialization failed"
    replay(excerpt(FAILED, "EngineCore failed to start.", exc, labels=("EngineCore",)), important=True)
    replay(excerpt(FAILED, "Process EngineCore:", exc), important=True)
    stop_children(list(workers.values()), graceful=False)
    send(ready_w, b"F")
    os._exit(1)


def _engine_serve(cfg: Config, workers: dict[int, int]) -> NoReturn:
    t_ready = time.monotonic()
    killed = False
    alive = dict(workers)
    while True:
        pause(0.05, step=0.05)
        due = cfg.kill_worker_after_ready is not None and time.monotonic() - t_ready >= cfg.kill_worker_after_ready
        if due and not killed:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(workers[0], signal.SIGKILL)
        for rank, pid in list(alive.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                del alive[rank]
                pause(0.05)  # a group-wide SIGTERM is not a failure
                _engine_worker_died(cfg, rank, os.waitstatus_to_exitcode(status), list(alive.values()))


def _engine_worker_died(cfg: Config, rank: int, code: int, others: list[int]) -> NoReturn:
    subs = {"VllmWorker-0": f"VllmWorker-{rank}", "(exit code: -9)": f"(exit code: {code})"}
    last = "RuntimeError: Executor failed."
    replay(excerpt(WORKER_KILLED, "died unexpectedly", last, labels=("EngineCore",)), subs, important=True)
    replay(excerpt(WORKER_KILLED, "Process EngineCore:", last), important=True)
    if not cfg.orphan_workers:
        stop_children(others, graceful=False)
    os._exit(1)
