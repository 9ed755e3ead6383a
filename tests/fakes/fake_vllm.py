#!/usr/bin/env python3
"""A fake ``vllm serve`` used to test kimi-supervisor against real processes.

Stdlib only.  It reproduces the parts of vLLM 0.11 that a supervisor sees:

* the process tree: the main "APIServer" process forks one EngineCore process
  (title ``VLLM::EngineCore``), which forks N tensor-parallel workers (titles
  ``VLLM::Worker_TP0`` ...; ``VLLM::Worker`` when N == 1).  The kernel keeps 15
  bytes of a process name, so /proc/PID/comm reads ``VLLM::Worker_TP`` and
  ``VLLM::EngineCor``; argv is rewritten too, so /proc/PID/cmdline (and
  psutil's ``name()``) give the full title.  The main process names itself
  ``vllm`` in comm, as the ``vllm`` console script would be.
* log lines in vLLM's shapes on stdout (logger lines) and stderr (uvicorn,
  tqdm progress bars, tracebacks), each written with one ``write(2)``;
* the HTTP port is bound early but only listened on once the engine is up
  (connections are refused until then), then GET /health, /ping, /version,
  /v1/models, /metrics and POST /v1/completions, /v1/chat/completions;
* SIGTERM/SIGINT handling, failure modes and pathologies chosen by flags.

Run ``python tests/fakes/fake_vllm.py serve --help`` for every flag.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import NoReturn

_SITE = "/usr/local/lib/python3.12/dist-packages"
_V = f"{_SITE}/vllm"
_PYLIB = "/usr/lib/python3.12"
_CHILD_GRACE_S = 2.0
_POLL_S = 0.02
_EXIT_LIFETIME = 3

Frame = tuple[str, int, str, str | None]


# --------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Config:
    model: str
    served_name: str
    host: str
    port: int
    tp: int
    max_model_len: int
    gpu_util: float
    access_log: bool
    version: str
    log_format: str
    load_seconds: float
    shards: int
    progress: str
    crash_during_load: bool
    fatal_line: str | None
    fatal_after: float
    free_memory_error: bool
    hang_after_ready: float | None
    unhealthy_after: float | None
    wedged_after: float | None
    ignore_sigterm: bool
    ignore_sigterm_during_load: bool
    orphan_workers: bool
    worker_setsid: bool
    exit_after_ready: float | None
    exit_code: int
    kill_worker_after_ready: float | None
    kill_worker_rank: int
    engine_death_exit_delay: float
    engine_death_exit_code: int
    flood_lines: int
    flood_only: bool
    flood_line_bytes: int
    flood_stream: str
    long_line: int
    long_line_no_newline: bool
    invalid_utf8: bool
    silent_load: bool
    hold_shm: str | None
    stop_delay: float
    stats_interval: float
    color: bool
    children_inherit_socket: bool
    max_lifetime: float

    @property
    def new_format(self) -> bool:
        return self.log_format == "new"


# vLLM options that take a value: declared (and ignored) so that their value
# is never mistaken for the positional MODEL argument.
_IGNORED_VALUE_FLAGS = (
    "--dtype",
    "--kv-cache-dtype",
    "--quantization",
    "-q",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--tool-call-parser",
    "--reasoning-parser",
    "--chat-template",
    "--tokenizer",
    "--tokenizer-mode",
    "--revision",
    "--download-dir",
    "--load-format",
    "--seed",
    "--block-size",
    "--swap-space",
    "--api-key",
    "--uvicorn-log-level",
    "--distributed-executor-backend",
    "--generation-config",
    "--compilation-config",
    "-O",
    "--speculative-config",
    "--limit-mm-per-prompt",
    "--hf-overrides",
    "--override-generation-config",
    "--root-path",
    "--allowed-origins",
    "--max-log-len",
    "--cpu-offload-gb",
    "--config",
    "--worker-cls",
    "--shutdown-timeout",
    "--max-cudagraph-capture-size",
    "--mm-encoder-tp-mode",
)

_DESCRIPTION = """\
Fake `vllm serve`: same argv shape as real vLLM, stdlib only.

Normal start (default timings sum to about --load-seconds): the APIServer
prints its banner and binds (no listen) the port, forks EngineCore, which
forks the TP workers; worker 0 prints the safetensors and CUDA-graph progress
bars; when every worker is ready the APIServer prints "Starting vLLM API
server 0 on http://HOST:PORT", the routes and the uvicorn startup lines, and
starts listening.  SIGTERM/SIGINT after that: shutdown lines, children
stopped, exit 0.  SIGTERM/SIGINT during load: KeyboardInterrupt traceback,
children stopped, then the process kills itself with SIGINT (what Python
does on an uncaught KeyboardInterrupt).
"""

_EPILOG = """\
Other vLLM flags (e.g. --dtype X, --trust-remote-code, --enable-expert-parallel)
are accepted and ignored.  A leading `serve` argument is optional.

Exit codes (main process): 0 clean shutdown / --flood-only / engine death
(see --engine-death-exit-code); 1 engine start failure, --fatal-line, port
bind failure; killed by SIGINT after SIGTERM/SIGINT during load; 3 when
--max-lifetime expires; --exit-code C with --exit-after-ready.
"""


def _int_with_suffix(text: str) -> int:
    """Parse vLLM-style sizes such as 131072, 128k, 1M."""
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    return int(float(t) * mult)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fake_vllm.py serve",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="model directory or name, as in `vllm serve MODEL` (need not exist)",
    )
    v = p.add_argument_group("vLLM options the fake uses")
    v.add_argument("--model", default=None, help="same as MODEL")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, dest="tp", help="number of worker processes (default 1)"
    )
    v.add_argument(
        "--served-model-name", nargs="+", default=None, help="model id reported by /v1/models (default: MODEL)"
    )
    v.add_argument(
        "--max-model-len",
        type=_int_with_suffix,
        default=131072,
        help="only printed (default 131072; 128k style accepted)",
    )
    v.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        dest="gpu_util",
        help="only printed, e.g. by --free-memory-error (default 0.9)",
    )
    v.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="do not print uvicorn access lines ('INFO:     127.0.0.1:PORT - \"GET /health HTTP/1.1\" 200 OK')",
    )
    for flag in _IGNORED_VALUE_FLAGS:
        p.add_argument(flag, dest="ignored" + flag.replace("-", "_"), help=argparse.SUPPRESS)

    f = p.add_argument_group("fake_vllm: output shape")
    f.add_argument("--vllm-version", default="0.11.0", help="version printed in the banner (default 0.11.0)")
    f.add_argument(
        "--log-format",
        choices=("0.11", "new"),
        default="0.11",
        help="0.11: 'Starting vLLM API server 0 on URL', 'Model loading "
        "took X GiB and Y seconds'; new (later vLLM): 'Starting vLLM "
        "server on URL', 'Model loading took X GiB memory and Y "
        "seconds', 'Free memory on device cuda:0 (...)'",
    )
    f.add_argument(
        "--progress",
        choices=("real", "newline", "cr"),
        default="real",
        help="how progress bars are written to stderr.  real (default, "
        "like vLLM 0.11 through a pipe): safetensors bar as "
        "'(Worker_TP0 pid=N) \\rLoading ...\\n' per update, CUDA-graph "
        "bar as '\\r...' updates on one line ended by '\\n'; newline: "
        "each update its own unprefixed line; cr: '\\r'-separated "
        "updates, one '\\n' at the end of each bar",
    )
    f.add_argument("--color", action="store_true", help="wrap the '(Label pid=N)' prefix in ANSI colour codes")
    f.add_argument(
        "--stats-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="after ready, print an 'Engine 000: Avg prompt throughput' line every S seconds (default 0 = never)",
    )

    t = p.add_argument_group("fake_vllm: timings")
    t.add_argument(
        "--load-seconds",
        type=float,
        default=1.0,
        metavar="F",
        help="time from start to listening on the port (default 1.0)",
    )
    t.add_argument(
        "--shards", type=int, default=8, metavar="K", help="safetensors shards, i.e. progress steps (default 8)"
    )
    t.add_argument(
        "--stop-delay",
        type=float,
        default=0.1,
        metavar="F",
        help="pause inside the graceful SIGTERM shutdown (default 0.1)",
    )
    t.add_argument(
        "--max-lifetime",
        type=float,
        default=300.0,
        metavar="S",
        help="safety net: every fake process exits (code 3) after S "
        "seconds whatever its mode, so leaks do not live forever "
        "(default 300; 0 = no limit)",
    )

    m = p.add_argument_group("fake_vllm: failure modes")
    m.add_argument(
        "--crash-during-load",
        action="store_true",
        help="worker 0 fails half-way through the shards with a CUDA OOM; "
        "EngineCore and APIServer print real-shaped tracebacks "
        "ending 'RuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}'; exit 1",
    )
    m.add_argument(
        "--free-memory-error",
        action="store_true",
        help="worker 0 fails at device init with 'ValueError: Free memory "
        "on device (...) on startup is less than desired GPU memory "
        "utilization (U, X GiB). ...'; same chain; exit 1",
    )
    m.add_argument(
        "--fatal-line",
        default=None,
        metavar="TEXT",
        help="after --fatal-after seconds print TEXT verbatim to stderr, stop the children, exit 1",
    )
    m.add_argument(
        "--fatal-after",
        type=float,
        default=0.2,
        metavar="F",
        help="delay before --fatal-line (default 0.2; engine is running)",
    )
    m.add_argument(
        "--hang-after-ready",
        type=float,
        default=None,
        metavar="S",
        help="S seconds after ready: every HTTP request (incl. /health) "
        "is accepted but never answered and all output stops",
    )
    m.add_argument(
        "--unhealthy-after", type=float, default=None, metavar="S", help="S seconds after ready /health answers 503"
    )
    m.add_argument(
        "--wedged-after",
        type=float,
        default=None,
        metavar="S",
        help="S seconds after ready the engine wedges (a GPU page fault, an NCCL hang): /health stays 200, "
        "completions are accepted and never answered, /metrics freezes with 2 requests running "
        "(plus the hung ones) and generation_tokens_total unchanged",
    )
    m.add_argument(
        "--exit-after-ready",
        type=float,
        default=None,
        metavar="S",
        help="S seconds after ready the main process prints the uvicorn "
        "shutdown lines, stops its children, exits --exit-code",
    )
    m.add_argument(
        "--exit-code", type=int, default=0, metavar="C", help="exit status for --exit-after-ready (default 0)"
    )
    m.add_argument(
        "--kill-worker-after-ready",
        type=float,
        default=None,
        metavar="S",
        help="S seconds after ready EngineCore SIGKILLs worker "
        "--kill-worker-rank, prints 'Worker proc VllmWorker-R died "
        "unexpectedly' and 'EngineCore encountered a fatal error' and "
        "exits 1; APIServer prints 'Engine core proc EngineCore_DP0 "
        "died unexpectedly, shutting down client.', answers 503 for "
        "--engine-death-exit-delay, then shuts down and exits 0.  "
        "(Killing a worker or EngineCore from outside does the same.)",
    )
    m.add_argument(
        "--kill-worker-rank",
        type=int,
        default=0,
        metavar="R",
        help="worker killed by --kill-worker-after-ready (default 0)",
    )
    m.add_argument(
        "--engine-death-exit-delay",
        type=float,
        default=0.5,
        metavar="F",
        help="seconds between engine death and the main process exiting (vLLM's watchdog takes up to 5 s; default 0.5)",
    )
    m.add_argument(
        "--engine-death-exit-code",
        type=int,
        default=0,
        metavar="C",
        help="main exit status after engine death (default 0, as vLLM)",
    )

    s = p.add_argument_group("fake_vllm: signals and process tree")
    s.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="every fake process ignores SIGTERM, SIGINT and SIGHUP; only SIGKILL works",
    )
    s.add_argument(
        "--ignore-sigterm-during-load",
        action="store_true",
        help="every fake process ignores SIGTERM/SIGINT/SIGHUP until it "
        "is ready (a signal sent then is lost), then handles them",
    )
    s.add_argument(
        "--orphan-workers",
        action="store_true",
        help="EngineCore and workers ignore SIGHUP, do not exit when "
        "their parent dies, and nobody signals its children on exit: "
        "SIGTERM to the main process alone leaves them running "
        "(each still exits on its own SIGTERM unless --ignore-sigterm)",
    )
    s.add_argument(
        "--worker-setsid",
        action="store_true",
        help="workers call setsid(): they leave the process group and "
        "session, so killpg() of the main group misses them",
    )
    s.add_argument(
        "--children-inherit-socket",
        action="store_true",
        help="EngineCore and workers keep the inherited server socket open, so the port stays taken while they live",
    )
    s.add_argument(
        "--hold-shm",
        default=None,
        metavar="PATH",
        help="create PATH (1 MiB), keep it open and mmapped in every "
        "process, like NCCL's /dev/shm files; the main process "
        "unlinks it on any exit it controls (not on SIGKILL)",
    )

    o = p.add_argument_group("fake_vllm: output stress")
    o.add_argument(
        "--flood-lines",
        type=int,
        default=0,
        metavar="N",
        help="print N log lines as fast as possible at startup, before forking the engine",
    )
    o.add_argument(
        "--flood-only", action="store_true", help="print the --flood-lines lines and exit 0 (no processes, no port)"
    )
    o.add_argument(
        "--flood-line-bytes",
        type=int,
        default=120,
        metavar="B",
        help="length of each flood line incl. newline (default 120)",
    )
    o.add_argument(
        "--flood-stream",
        choices=("stdout", "stderr", "both"),
        default="stdout",
        help="where flood lines go; both alternates 64 KiB chunks",
    )
    o.add_argument(
        "--long-line",
        type=int,
        default=0,
        metavar="BYTES",
        help="early on, print one stdout line of BYTES bytes (newline not counted)",
    )
    o.add_argument(
        "--long-line-no-newline",
        action="store_true",
        help="omit the newline after --long-line (the next log line continues it)",
    )
    o.add_argument(
        "--invalid-utf8",
        action="store_true",
        help="early on, print invalid UTF-8 on stdout and stderr, and a valid 2-byte character split across two writes",
    )
    o.add_argument("--silent-load", action="store_true", help="print nothing (errors excepted) until ready")
    return p


def parse_config(argv: Sequence[str]) -> Config:
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    ns, _unknown = build_parser().parse_known_args(args)
    model = str(ns.model_tag or ns.model or "/models/fake-model")
    names = ns.served_model_name
    served = str(names[0]) if names else model
    return Config(
        model=model,
        served_name=served,
        host=str(ns.host),
        port=int(ns.port),
        tp=max(1, int(ns.tp)),
        max_model_len=int(ns.max_model_len),
        gpu_util=float(ns.gpu_util),
        access_log=not bool(ns.disable_uvicorn_access_log),
        version=str(ns.vllm_version),
        log_format=str(ns.log_format),
        load_seconds=max(0.0, float(ns.load_seconds)),
        shards=max(1, int(ns.shards)),
        progress=str(ns.progress),
        crash_during_load=bool(ns.crash_during_load),
        fatal_line=ns.fatal_line,
        fatal_after=max(0.0, float(ns.fatal_after)),
        free_memory_error=bool(ns.free_memory_error),
        hang_after_ready=ns.hang_after_ready,
        unhealthy_after=ns.unhealthy_after,
        wedged_after=ns.wedged_after,
        ignore_sigterm=bool(ns.ignore_sigterm),
        ignore_sigterm_during_load=bool(ns.ignore_sigterm_during_load),
        orphan_workers=bool(ns.orphan_workers),
        worker_setsid=bool(ns.worker_setsid),
        exit_after_ready=ns.exit_after_ready,
        exit_code=int(ns.exit_code),
        kill_worker_after_ready=ns.kill_worker_after_ready,
        kill_worker_rank=int(ns.kill_worker_rank),
        engine_death_exit_delay=max(0.0, float(ns.engine_death_exit_delay)),
        engine_death_exit_code=int(ns.engine_death_exit_code),
        flood_lines=max(0, int(ns.flood_lines)),
        flood_only=bool(ns.flood_only),
        flood_line_bytes=max(1, int(ns.flood_line_bytes)),
        flood_stream=str(ns.flood_stream),
        long_line=max(0, int(ns.long_line)),
        long_line_no_newline=bool(ns.long_line_no_newline),
        invalid_utf8=bool(ns.invalid_utf8),
        silent_load=bool(ns.silent_load),
        hold_shm=ns.hold_shm,
        stop_delay=max(0.0, float(ns.stop_delay)),
        stats_interval=max(0.0, float(ns.stats_interval)),
        color=bool(ns.color),
        children_inherit_socket=bool(ns.children_inherit_socket),
        max_lifetime=max(0.0, float(ns.max_lifetime)),
    )


# --------------------------------------------------------------------------
# per-process state, signals, sleeping


class _Stop(Exception):
    """Raised by pause()/check() when this process has to stop."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "signal" | "parent" | "lifetime"


class _Proc:
    label = "APIServer"
    pid = 0
    color = False
    quiet = False
    stop_requested = False
    watch_parent = False
    parent_pid = 0
    deadline = float("inf")


P = _Proc()


def _on_term(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    P.stop_requested = True


def install_term(ignore: bool) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if ignore else _on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore else signal.SIG_DFL)


def check() -> None:
    if P.stop_requested:
        raise _Stop("signal")
    if P.watch_parent and os.getppid() != P.parent_pid:
        raise _Stop("parent")
    if time.monotonic() > P.deadline:
        raise _Stop("lifetime")


def pause(seconds: float, step: float = _POLL_S) -> None:
    """Sleep, checking for SIGTERM / parent death / lifetime every `step` s."""
    end = time.monotonic() + max(0.0, seconds)
    while True:
        check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(step, left))


# --------------------------------------------------------------------------
# process names


def set_comm(name: str) -> None:
    """prctl(PR_SET_NAME): the kernel keeps 15 bytes (comm, psutil's stat name)."""
    raw = name.encode()[:15]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if int(libc.prctl(15, ctypes.c_char_p(raw), 0, 0, 0)) == 0:
            return
    except (OSError, AttributeError):
        pass
    with contextlib.suppress(OSError), open("/proc/self/comm", "wb") as fh:
        fh.write(raw)


def set_cmdline(title: str) -> None:
    """Overwrite this process's argv area (what setproctitle does).

    /proc/PID/cmdline then reads TITLE, and psutil's name() returns the full
    TITLE instead of the 15-byte comm.  Best effort: silently skipped if the
    argv area cannot be written.
    """
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
        size = end - start
        if size < 2:
            return
        text = title.encode()[: size - 2]
        # Title, NUL padding, and a non-NUL last byte: the kernel then reports
        # the argv area up to the first NUL (the setproctitle convention).
        buf = text + b"\0" * (size - len(text) - 1) + b" "
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            os.pwrite(fd, buf, start)
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        pass


def set_title(title: str) -> None:
    set_comm(title)
    set_cmdline(title)


# --------------------------------------------------------------------------
# output


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # reader gone: keep running, like a daemon would
        view = view[n:]


def ts() -> str:
    return time.strftime("%m-%d %H:%M:%S")


def prefix() -> str:
    tag = f"({P.label} pid={P.pid})"
    if P.color:
        tag = f"\x1b[0;36m{tag}\x1b[0;0m"
    return tag + " "


def log(level: str, where: str, msg: str, *, fd: int = 1) -> None:
    """A vLLM logger line (multi-line messages repeat the header per line)."""
    if P.quiet and level not in ("ERROR", "CRITICAL"):
        return
    head = f"{prefix()}{level} {ts()} [{where}] "
    write_all(fd, "".join(f"{head}{ln}\n" for ln in msg.split("\n")).encode())


def plain(lines: str | Sequence[str], *, fd: int = 2, important: bool = False, prefixed: bool = True) -> None:
    """Lines with only the '(Label pid=N) ' prefix (uvicorn, tracebacks)."""
    if P.quiet and not important:
        return
    items = [lines] if isinstance(lines, str) else list(lines)
    pre = prefix() if prefixed else ""
    write_all(fd, "".join(f"{pre}{ln}\n" for ln in items).encode())


def platform_line() -> None:
    """Printed by every vLLM process before its log prefix is installed."""
    if not P.quiet:
        write_all(1, f"INFO {ts()} [__init__.py:216] Automatically detected platform cuda.\n".encode())


def traceback_lines(frames: Sequence[Frame], exc: str) -> list[str]:
    out = ["Traceback (most recent call last):"]
    for path, line, func, code in frames:
        out.append(f'  File "{path}", line {line}, in {func}')
        if code is not None:
            out.append(f"    {code}")
    out.append(exc)
    return out


def _fmt_interval(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


_BLOCKS = " ▏▎▍▌▋▊▉"


def bar_text(desc: str, n: int, total: int, elapsed: float, tqdm_bar: bool) -> str:
    if n > 0 and elapsed > 0:
        rate = n / elapsed
        remaining = _fmt_interval((total - n) / rate)
        rate_s = f"{rate:5.2f}it/s" if rate >= 1 else f"{1 / rate:5.2f}s/it"
    else:
        remaining, rate_s = "?", "?it/s"
    tail = f"{n}/{total} [{_fmt_interval(elapsed)}<{remaining}, {rate_s}]"
    pct = 100.0 * n / total
    if not tqdm_bar:  # vLLM's own bar_format for safetensors loading
        return f"{desc}: {pct:3.0f}% Completed | {tail}"
    frac = 10.0 * n / total
    full = int(frac)
    bar = "█" * full
    if full < 10:
        bar += _BLOCKS[int((frac - full) * 8)]
    return f"{desc}: {pct:3.0f}%|{bar.ljust(10)}| {tail}"


class Progress:
    """tqdm-like bar on stderr, written in the style chosen by --progress."""

    def __init__(self, desc: str, total: int, mode: str, tqdm_bar: bool) -> None:
        self.desc, self.total, self.mode, self.tqdm_bar = desc, total, mode, tqdm_bar
        self.start = time.monotonic()
        self.n = 0
        self.first = True
        self.show()

    def _emit(self, text: str, closing: bool) -> None:
        if P.quiet:
            return
        if self.mode == "newline":
            out = text + "\n"
        elif self.mode == "cr":
            out = "\r" + text + ("\n" if closing else "")
        elif not self.tqdm_bar:  # real: bar_format ends in '\n'
            out = prefix() + "\r" + text + "\n"
        else:  # real: plain tqdm, one physical line until close
            out = (prefix() if self.first else "") + "\r" + text
            out += "\n" if closing else ""
        self.first = False
        write_all(2, out.encode())

    def show(self, closing: bool = False) -> None:
        elapsed = time.monotonic() - self.start
        self._emit(bar_text(self.desc, self.n, self.total, elapsed, self.tqdm_bar), closing)

    def update(self) -> None:
        self.n += 1
        self.show()

    def close(self) -> None:
        self.show(closing=True)


def run_bar(
    desc: str, total: int, seconds: float, mode: str, tqdm_bar: bool, fail_at: int | None = None, show: bool = True
) -> bool:
    """Advance a bar over `seconds`; False if it stopped at step `fail_at`."""
    bar = Progress(desc, total, mode, tqdm_bar) if show else None
    for i in range(1, total + 1):
        pause(seconds / total)
        if fail_at is not None and i == fail_at:
            if bar is not None and bar.mode == "cr" and not P.quiet:
                write_all(2, b"\n")
            return False
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return True


# --------------------------------------------------------------------------
# canned tracebacks (paths and line numbers as in vLLM 0.11 on Python 3.12)

_WORKER_START: list[Frame] = [
    (f"{_V}/v1/executor/multiproc_executor.py", 571, "worker_main", "worker = WorkerProc(*args, **kwargs)"),
]
_WORKER_LOAD_FRAMES: list[Frame] = [
    *_WORKER_START,
    (f"{_V}/v1/executor/multiproc_executor.py", 437, "__init__", "self.worker.load_model()"),
    (f"{_V}/v1/worker/gpu_worker.py", 214, "load_model", "self.model_runner.load_model(eep_scale_up=eep_scale_up)"),
    (f"{_V}/v1/worker/gpu_model_runner.py", 2642, "load_model", "self.model = model_loader.load_model("),
    (f"{_V}/model_executor/model_loader/base_loader.py", 50, "load_model", "self.load_weights(model, model_config)"),
    (
        f"{_V}/model_executor/model_loader/default_loader.py",
        264,
        "load_weights",
        "loaded_weights = model.load_weights(",
    ),
    (
        f"{_V}/model_executor/models/deepseek_v2.py",
        1412,
        "load_weights",
        "weight_loader(param, loaded_weight, name, shard_id=shard_id,",
    ),
    (f"{_V}/model_executor/layers/fused_moe/layer.py", 1290, "weight_loader", "expert_data.copy_(loaded_weight)"),
]
_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB. "
    "GPU 0 has a total capacity of 139.81 GiB of which 512.50 MiB is free. "
    "Including non-PyTorch memory, this process has 139.29 GiB memory in use. "
    "Of the allocated memory 137.12 GiB is allocated by PyTorch, and 1.24 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is "
    "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
_WORKER_INIT_FRAMES: list[Frame] = [
    *_WORKER_START,
    (f"{_V}/v1/executor/multiproc_executor.py", 432, "__init__", "self.worker.init_device()"),
    (f"{_V}/worker/worker_base.py", 611, "init_device", "self.worker.init_device()  # type: ignore"),
    (f"{_V}/v1/worker/gpu_worker.py", 193, "init_device", "raise ValueError("),
]
_ENGINE_INIT_FRAMES: list[Frame] = [
    (f"{_V}/v1/engine/core.py", 699, "run_engine_core", "engine_core = EngineCoreProc(*args, **kwargs)"),
    (f"{_V}/v1/engine/core.py", 498, "__init__", "super().__init__(vllm_config, executor_class, log_stats,"),
    (f"{_V}/v1/engine/core.py", 83, "__init__", "self.model_executor = executor_class(vllm_config)"),
    (f"{_V}/executor/executor_base.py", 54, "__init__", "self._init_executor()"),
    (
        f"{_V}/v1/executor/multiproc_executor.py",
        106,
        "_init_executor",
        "self.workers = WorkerProc.wait_for_ready(unready_workers)",
    ),
    (f"{_V}/v1/executor/multiproc_executor.py", 509, "wait_for_ready", "raise e from None"),
]
_WORKER_INIT_EXC = (
    "Exception: WorkerProc initialization failed due to an exception in a "
    "background process. See stack trace for root cause."
)
_MP_FRAMES: list[Frame] = [
    (f"{_PYLIB}/multiprocessing/process.py", 314, "_bootstrap", "self.run()"),
    (f"{_PYLIB}/multiprocessing/process.py", 108, "run", "self._target(*self._args, **self._kwargs)"),
]
_ENGINE_BUSY_FRAMES: list[Frame] = [
    (f"{_V}/v1/engine/core.py", 701, "run_engine_core", "engine_core.run_busy_loop()"),
    (f"{_V}/v1/engine/core.py", 726, "run_busy_loop", "self._process_input_queue()"),
    (f"{_V}/v1/engine/core.py", 751, "_process_input_queue", "self._handle_client_request(*req)"),
    (f"{_V}/v1/engine/core.py", 806, "_handle_client_request", 'raise RuntimeError("Executor failed.")'),
]
_API = f"{_V}/entrypoints/openai/api_server.py"
_API_ENTRY: list[Frame] = [
    ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
    (f"{_V}/entrypoints/cli/main.py", 54, "main", "args.dispatch_function(args)"),
    (f"{_V}/entrypoints/cli/serve.py", 57, "cmd", "uvloop.run(run_server(args))"),
    (f"{_SITE}/uvloop/__init__.py", 109, "run", "return __asyncio.run("),
    (f"{_PYLIB}/asyncio/runners.py", 195, "run", "return runner.run(main)"),
    (f"{_PYLIB}/asyncio/runners.py", 118, "run", "return self._loop.run_until_complete(task)"),
    ("uvloop/loop.pyx", 1518, "uvloop.loop.Loop.run_until_complete", None),
    (f"{_SITE}/uvloop/__init__.py", 61, "wrapper", "return await main"),
]
_API_ENGINE_START: list[Frame] = [
    *_API_ENTRY,
    (_API, 1884, "run_server", "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    (_API, 1902, "run_server_worker", "async with build_async_engine_client("),
    (f"{_PYLIB}/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    (_API, 180, "build_async_engine_client", "async with build_async_engine_client_from_engine_args("),
    (f"{_PYLIB}/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    (_API, 225, "build_async_engine_client_from_engine_args", "async_llm = AsyncLLM.from_vllm_config("),
    (f"{_V}/utils/__init__.py", 1572, "inner", "return fn(*args, **kwargs)"),
    (f"{_V}/v1/engine/async_llm.py", 207, "from_vllm_config", "return cls("),
    (f"{_V}/v1/engine/async_llm.py", 134, "__init__", "self.engine_core = EngineCoreClient.make_async_mp_client("),
    (f"{_V}/v1/engine/core_client.py", 102, "make_async_mp_client", "return AsyncMPClient(*client_args)"),
    (f"{_V}/v1/engine/core_client.py", 769, "__init__", "super().__init__("),
    (f"{_V}/v1/engine/core_client.py", 448, "__init__", "with launch_core_engines(vllm_config, executor_class,"),
]
_API_INIT_FAILED: list[Frame] = [
    *_API_ENGINE_START,
    (f"{_PYLIB}/contextlib.py", 144, "__exit__", "next(self.gen)"),
    (f"{_V}/v1/engine/utils.py", 732, "launch_core_engines", "wait_for_engine_startup("),
    (
        f"{_V}/v1/engine/utils.py",
        785,
        "wait_for_engine_startup",
        'raise RuntimeError("Engine core initialization failed. "',
    ),
]
ROOT_CAUSE = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
_API_INTERRUPTED: list[Frame] = [
    *_API_ENGINE_START,
    (f"{_V}/v1/engine/utils.py", 732, "launch_core_engines", "wait_for_engine_startup("),
    (f"{_V}/v1/engine/utils.py", 770, "wait_for_engine_startup", "events = poller.poll(STARTUP_POLL_PERIOD_MS)"),
    (_API, 1862, "signal_handler", 'raise KeyboardInterrupt("terminated")'),
]
_API_BIND: list[Frame] = [
    *_API_ENTRY,
    (_API, 1870, "run_server", "listen_address, sock = setup_server(args)"),
    (_API, 1829, "setup_server", "sock = create_server_socket(sock_addr)"),
    (_API, 1790, "create_server_socket", "sock.bind(addr)"),
]


# --------------------------------------------------------------------------
# child process helpers


def fork_child(label: str, title: str, cfg: Config, close_fds: Sequence[int]) -> int:
    """Fork; in the child set up identity/signals and return 0."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    for fd in close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    P.label = label
    P.pid = os.getpid()
    P.stop_requested = False
    P.parent_pid = parent
    P.watch_parent = not cfg.orphan_workers
    set_title(title)
    install_term(cfg.ignore_sigterm or cfg.ignore_sigterm_during_load)
    if cfg.orphan_workers and not cfg.ignore_sigterm:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return 0


def reap(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait for our children `pids`; return those still alive after timeout."""
    alive = list(pids)
    end = time.monotonic() + timeout
    while alive:
        for pid in list(alive):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                alive.remove(pid)
        if not alive or time.monotonic() >= end:
            break
        time.sleep(_POLL_S)
    return alive


def stop_children(pids: Sequence[int], graceful: bool) -> None:
    """SIGTERM (then SIGKILL after a grace period) or SIGKILL our own children."""
    live = [p for p in pids if p > 0]
    if not live:
        return
    first = signal.SIGTERM if graceful else signal.SIGKILL
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, first)
    left = reap(live, _CHILD_GRACE_S if graceful else 1.0)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reap(left, 1.0)


def send(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, data)


def lifetime_exit(children: Sequence[int]) -> NoReturn:
    write_all(2, f"fake_vllm: {P.label} pid={P.pid}: --max-lifetime reached, exiting\n".encode())
    stop_children(children, graceful=False)
    os._exit(_EXIT_LIFETIME)


# --------------------------------------------------------------------------
# worker


def worker_main(cfg: Config, rank: int, ready_w: int) -> NoReturn:
    if cfg.worker_setsid:
        with contextlib.suppress(OSError):
            os.setsid()
    ready = False
    try:
        _worker_load(cfg, rank, ready_w)
        ready = True
        install_term(cfg.ignore_sigterm)
        if cfg.orphan_workers and not cfg.ignore_sigterm:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        while True:
            pause(3600.0, step=0.05)
    except _Stop as stop:
        if stop.reason == "lifetime":
            lifetime_exit([])
        if stop.reason == "signal" and ready and not P.quiet:
            stamp = time.strftime("%m%d %H:%M:%S")
            write_all(
                2,
                (
                    f"[rank{rank}]:[W{stamp}.{time.time_ns() % 10**9:09d} "
                    "ProcessGroupNCCL.cpp:1538] Warning: WARNING: destroy_process_group()"
                    " was not called before program exit, which can leak resources. "
                    "For more info, please see "
                    "https://pytorch.org/docs/stable/distributed.html#shutdown "
                    "(function operator())\n"
                ).encode(),
            )
        os._exit(0)


def _worker_fail(frames: Sequence[Frame], exc: str, ready_w: int) -> NoReturn:
    where = "multiproc_executor.py:597"
    log("ERROR", where, "WorkerProc failed to start.")
    log("ERROR", where, "\n".join(traceback_lines(frames, exc)))
    send(ready_w, b"F")
    os._exit(1)


def _worker_load(cfg: Config, rank: int, ready_w: int) -> None:
    L = cfg.load_seconds
    show = rank == 0
    platform_line()
    pause(0.05 * L)
    log(
        "INFO",
        "parallel_state.py:1208",
        f"rank {rank} in world size {cfg.tp} is assigned as DP rank 0, PP rank 0, TP rank {rank}, EP rank {rank}",
    )
    if cfg.free_memory_error and rank == 0:
        total = 139.81
        dev = "cuda:0 " if cfg.new_format else ""
        _worker_fail(
            _WORKER_INIT_FRAMES,
            (
                f"ValueError: Free memory on device {dev}(12.34/{total:.2f} GiB) on "
                f"startup is less than desired GPU memory utilization "
                f"({cfg.gpu_util}, {cfg.gpu_util * total:.2f} GiB). Decrease GPU "
                "memory utilization or reduce GPU memory used by other processes."
            ),
            ready_w,
        )
    log("INFO", "gpu_model_runner.py:2602", f"Starting to load model {cfg.model}...")
    log("INFO", "gpu_model_runner.py:2634", "Loading model from scratch...")
    log("INFO", "cuda.py:366", "Using FlashMLA backend on V1 engine.")
    fail_at = max(1, cfg.shards // 2) if (cfg.crash_during_load and rank == 0) else None
    t0 = time.monotonic()
    ok = run_bar(
        "Loading safetensors checkpoint shards",
        cfg.shards,
        0.55 * L,
        cfg.progress,
        tqdm_bar=False,
        fail_at=fail_at,
        show=show,
    )
    if not ok:
        _worker_fail(_WORKER_LOAD_FRAMES, _OOM, ready_w)
    took = time.monotonic() - t0
    log("INFO", "default_loader.py:267", f"Loading weights took {took:.2f} seconds")
    mem = 70.8 + rank * 0.0013
    if cfg.new_format:
        log("INFO", "gpu_model_runner.py:2653", f"Model loading took {mem:.2f} GiB memory and {took + 0.1:.6f} seconds")
    else:
        log("INFO", "gpu_model_runner.py:2653", f"Model loading took {mem:.4f} GiB and {took + 0.1:.6f} seconds")
    pause(0.05 * L)
    log(
        "INFO",
        "backends.py:548",
        "Using cache directory: /root/.cache/vllm/torch_compile_cache/3f2a9c1e7b/"
        f"rank_{rank}_0/backbone for vLLM's torch.compile",
    )
    log("INFO", "backends.py:559", "Dynamo bytecode transform time: 12.41 s")
    log("INFO", "monitor.py:34", "torch.compile takes 31.87 s in total")
    pause(0.05 * L)
    log("INFO", "gpu_worker.py:298", "Available KV cache memory: 45.12 GiB")
    send(ready_w, b"K")
    run_bar(
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)", 5, 0.1 * L, cfg.progress, tqdm_bar=True, show=show
    )
    log("INFO", "gpu_model_runner.py:3480", "Graph capturing finished in 9 secs, took 0.86 GiB")
    send(ready_w, b"R")


# --------------------------------------------------------------------------
# engine core


def engine_main(cfg: Config, ready_w: int) -> NoReturn:
    workers: dict[int, int] = {}
    try:
        platform_line()
        log("INFO", "core.py:644", "Waiting for init message from front-end.")
        pause(0.05 * cfg.load_seconds)
        log(
            "INFO",
            "core.py:77",
            (
                f"Initializing a V1 LLM engine (v{cfg.version}) with config: "
                f"model='{cfg.model}', speculative_config=None, tokenizer='{cfg.model}', "
                "skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, "
                "tokenizer_revision=None, trust_remote_code=True, dtype=torch.bfloat16, "
                f"max_seq_len={cfg.max_model_len}, download_dir=None, load_format=auto, "
                f"tensor_parallel_size={cfg.tp}, pipeline_parallel_size=1, "
                "data_parallel_size=1, disable_custom_all_reduce=False, "
                "quantization=compressed-tensors, enforce_eager=False, "
                "kv_cache_dtype=auto, device_config=cuda, seed=0, "
                f"served_model_name={cfg.served_name}, enable_prefix_caching=True, "
                "chunked_prefill_enabled=True, pooler_config=None"
            ),
        )
        if cfg.tp > 1:
            log(
                "WARNING",
                "multiproc_worker_utils.py:273",
                "Reducing Torch parallelism from 64 threads to 1 to avoid "
                "unnecessary CPU contention. Set OMP_NUM_THREADS in the external "
                "environment to tune this value as needed.",
            )
        ranks = ", ".join(str(r) for r in range(cfg.tp))
        log(
            "INFO",
            "shm_broadcast.py:289",
            (
                "vLLM message queue communication handle: Handle(local_reader_ranks="
                f"[{ranks}], buffer_handle=({cfg.tp}, 16777216, 10, 'psm_5f2c1a3b'), "
                "local_subscribe_addr='ipc:///tmp/8c1e4f0a-2b7d-4d0e-9a51-0c3d2e1f6a7b',"
                " remote_subscribe_addr=None, remote_addr_ipv6=False)"
            ),
        )
        pipes: dict[int, int] = {}
        for rank in range(cfg.tp):
            r, w = os.pipe()
            name = f"Worker_TP{rank}" if cfg.tp > 1 else "Worker"
            pid = fork_child(name, f"VLLM::{name}", cfg, [ready_w, r, *pipes.keys()])
            if pid == 0:
                worker_main(cfg, rank, w)
            os.close(w)
            workers[rank] = pid
            pipes[r] = rank
        _engine_wait_ready(cfg, workers, pipes, ready_w)
        install_term(cfg.ignore_sigterm)
        if cfg.orphan_workers and not cfg.ignore_sigterm:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _engine_serve(cfg, workers)
    except _Stop as stop:
        kids = list(workers.values())
        if stop.reason == "lifetime":
            lifetime_exit(kids)
        if not cfg.orphan_workers:
            stop_children(kids, graceful=stop.reason == "signal")
        os._exit(0)


def _engine_fail(workers: dict[int, int], ready_w: int) -> NoReturn:
    where = "core.py:708"
    log("ERROR", where, "EngineCore failed to start.")
    log("ERROR", where, "\n".join(traceback_lines(_ENGINE_INIT_FRAMES, _WORKER_INIT_EXC)))
    frames = [*_MP_FRAMES, (f"{_V}/v1/engine/core.py", 712, "run_engine_core", "raise e"), *_ENGINE_INIT_FRAMES]
    plain(["Process EngineCore_DP0:", *traceback_lines(frames, _WORKER_INIT_EXC)], important=True)
    stop_children(list(workers.values()), graceful=False)
    send(ready_w, b"F")
    os._exit(1)


def _engine_wait_ready(cfg: Config, workers: dict[int, int], pipes: dict[int, int], ready_w: int) -> None:
    t0 = time.monotonic()
    kv_pending = set(workers)
    pending = set(workers)
    open_fds = dict(pipes)
    while pending:
        check()
        try:
            readable, _, _ = select.select(list(open_fds), [], [], 0.05)
        except InterruptedError:
            continue
        for fd in readable:
            rank = open_fds[fd]
            data = os.read(fd, 64)
            if not data or b"F" in data:
                pause(0.05)  # a group-wide SIGTERM is not a failure
                _engine_fail(workers, ready_w)
            if b"K" in data:
                kv_pending.discard(rank)
                if not kv_pending:
                    log("INFO", "kv_cache_utils.py:1087", "GPU KV cache size: 1,234,560 tokens")
                    log(
                        "INFO",
                        "kv_cache_utils.py:1091",
                        f"Maximum concurrency for {cfg.max_model_len:,} tokens per request: 9.42x",
                    )
            if b"R" in data:
                pending.discard(rank)
                os.close(fd)
                del open_fds[fd]
    log(
        "INFO",
        "core.py:210",
        f"init engine (profile, create kv cache, warmup model) took {time.monotonic() - t0 + 37.5:.2f} seconds",
    )
    send(ready_w, b"R")
    os.close(ready_w)


def _engine_serve(cfg: Config, workers: dict[int, int]) -> NoReturn:
    t_ready = time.monotonic()
    killed = False
    alive = dict(workers)
    while True:
        pause(0.05, step=0.05)
        if (
            cfg.kill_worker_after_ready is not None
            and not killed
            and time.monotonic() - t_ready >= cfg.kill_worker_after_ready
        ):
            killed = True
            victim = workers.get(cfg.kill_worker_rank, workers[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        for rank, pid in list(alive.items()):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                del alive[rank]
                pause(0.05)  # a group-wide SIGTERM is not a failure
                _engine_worker_died(cfg, rank, list(alive.values()))


def _engine_worker_died(cfg: Config, rank: int, others: list[int]) -> NoReturn:
    log(
        "ERROR",
        "multiproc_executor.py:154",
        f"Worker proc VllmWorker-{rank} died unexpectedly, shutting down executor.",
    )
    where = "core.py:710"
    log("ERROR", where, "EngineCore encountered a fatal error.")
    log("ERROR", where, "\n".join(traceback_lines(_ENGINE_BUSY_FRAMES, "RuntimeError: Executor failed.")))
    if not cfg.orphan_workers:
        stop_children(others, graceful=False)
    os._exit(1)


# --------------------------------------------------------------------------
# HTTP server (APIServer)


class _AppState:
    cfg: Config
    hung = False
    unhealthy = False
    engine_dead = False
    wedged = False
    running = 0  # requests "in the engine": the wedged ones
    generation_tokens = 0
    lock = threading.Lock()
    created = int(time.time())


APP = _AppState()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"

    def version_string(self) -> str:
        return "uvicorn"

    def log_message(self, fmt: str, *args: object) -> None:
        del fmt, args

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _hang(self) -> NoReturn:
        while True:
            time.sleep(3600)

    def _body(self) -> dict[str, object]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _send(self, status: int, body: bytes, ctype: str | None) -> None:
        self.send_response(status)  # adds the Server and Date headers
        if ctype is not None:
            self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if APP.cfg.access_log:
            host, port = self.client_address[:2]
            phrase = self.responses.get(status, ("",))[0]
            plain(f'INFO:     {host}:{port} - "{self.command} {self.path} HTTP/1.1" {status} {phrase}', fd=1)

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _route(self, method: str) -> None:
        if APP.hung:
            self._hang()
        cfg = APP.cfg
        path = self.path.split("?", 1)[0]
        body = self._body() if method == "POST" else {}
        if APP.hung:
            self._hang()
        routes = {
            "/health": "GET",
            "/ping": "GET",
            "/version": "GET",
            "/v1/models": "GET",
            "/metrics": "GET",
            "/v1/completions": "POST",
            "/v1/chat/completions": "POST",
        }
        if path not in routes:
            self._json(404, {"detail": "Not Found"})
        elif routes[path] != method:
            self._json(405, {"detail": "Method Not Allowed"})
        elif path in ("/health", "/ping"):
            bad = APP.unhealthy or APP.engine_dead
            self._send(503 if bad else 200, b"", None)
        elif path == "/version":
            self._json(200, {"version": cfg.version})
        elif path == "/metrics":
            self._send(200, _metrics_page(cfg.served_name).encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": cfg.served_name,
                            "object": "model",
                            "created": APP.created,
                            "owned_by": "vllm",
                            "root": cfg.model,
                            "parent": None,
                            "max_model_len": cfg.max_model_len,
                            "permission": [],
                        }
                    ],
                },
            )
        else:
            self._complete(path, body)

    def _complete(self, path: str, body: dict[str, object]) -> None:
        cfg = APP.cfg
        model = body.get("model", cfg.served_name)
        if model != cfg.served_name:
            self._json(
                404,
                {
                    "error": {
                        "message": f"The model `{model}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                },
            )
            return
        if APP.engine_dead:
            self._json(
                500,
                {
                    "error": {
                        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
            return
        if APP.wedged:
            with APP.lock:
                APP.running += 1
            self._hang()
        with APP.lock:
            APP.generation_tokens += 5
        text = " Hello from fake vLLM."
        prompt = str(body.get("prompt", body.get("messages", "")))
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": 5, "total_tokens": len(prompt.split()) + 5}
        now = int(time.time())
        if path == "/v1/completions":
            self._json(
                200,
                {
                    "id": f"cmpl-{uuid.uuid4().hex}",
                    "object": "text_completion",
                    "created": now,
                    "model": cfg.served_name,
                    "choices": [
                        {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
                    ],
                    "usage": usage,
                },
            )
        else:
            self._json(
                200,
                {
                    "id": f"chatcmpl-{uuid.uuid4().hex}",
                    "object": "chat.completion",
                    "created": now,
                    "model": cfg.served_name,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "length",
                            "stop_reason": None,
                        }
                    ],
                    "usage": usage,
                },
            )


def _metrics_page(model: str) -> str:
    """vLLM 0.32's names and shapes (tests/fixtures/vllm_cpu_0.32/metrics_*.txt), three of its metrics."""
    labels = f'engine="0",model_name="{model}"'
    with APP.lock:
        running, tokens = APP.running, APP.generation_tokens
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f"vllm:generation_tokens_total{{{labels}}} {float(tokens)}\n"
        f"vllm:generation_tokens_created{{{labels}}} {float(APP.created)}\n"
    )


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


# --------------------------------------------------------------------------
# APIServer (main process)


class Main:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.sock: socket.socket | None = None
        self.server: Server | None = None
        self.engine = 0
        self.engine_reaped = False
        self.ready_r = -1
        self.shm_fd = -1
        self.shm_map: mmap.mmap | None = None

    # -- helpers
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    def cleanup(self) -> None:
        if self.cfg.hold_shm and self.shm_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.cfg.hold_shm)

    def exit(self, code: int) -> NoReturn:
        self.cleanup()
        os._exit(code)

    def stop_engine(self, graceful: bool) -> None:
        if self.engine and not self.engine_reaped and not self.cfg.orphan_workers:
            stop_children([self.engine], graceful)
            self.engine_reaped = True

    def engine_exited(self) -> bool:
        if not self.engine or self.engine_reaped:
            return False
        try:
            done, _ = os.waitpid(self.engine, os.WNOHANG)
        except ChildProcessError:
            done = self.engine
        if done:
            self.engine_reaped = True
        return bool(done)

    # -- phases
    def run(self) -> NoReturn:
        cfg = self.cfg
        P.label, P.pid, P.color = "APIServer", os.getpid(), cfg.color
        P.quiet = cfg.silent_load
        if cfg.max_lifetime > 0:
            P.deadline = time.monotonic() + cfg.max_lifetime
        install_term(cfg.ignore_sigterm or cfg.ignore_sigterm_during_load)
        if cfg.flood_only:
            flood(cfg)
            os._exit(0)
        set_comm("vllm")
        try:
            self.hold_shm()
            self.banner()
            self.stress_output()
            self.bind()
            if cfg.flood_lines:
                flood(cfg)
            self.start_engine()
            if cfg.fatal_line is not None:
                pause(cfg.fatal_after)
                write_all(2, (cfg.fatal_line + "\n").encode())
                self.stop_engine(graceful=False)
                self.exit(1)
            self.wait_engine_ready()
        except _Stop as stop:
            self.stop_during_load(stop)
        self.ready()
        self.serve()

    def hold_shm(self) -> None:
        path = self.cfg.hold_shm
        if not path:
            return
        self.shm_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.shm_fd, 1 << 20)
        self.shm_map = mmap.mmap(self.shm_fd, 1 << 20)
        self.shm_map[:16] = b"fake-nccl-shm\0\0\0"

    def banner(self) -> None:
        cfg = self.cfg
        platform_line()
        log("INFO", "api_server.py:1839", f"vLLM API server version {cfg.version}")
        args = {
            "model_tag": cfg.model,
            "host": cfg.host,
            "port": cfg.port,
            "model": cfg.model,
            "trust_remote_code": True,
            "max_model_len": cfg.max_model_len,
            "served_model_name": [cfg.served_name],
            "tensor_parallel_size": cfg.tp,
            "gpu_memory_utilization": cfg.gpu_util,
        }
        log("INFO", "utils.py:233", f"non-default args: {args}")
        log("INFO", "model.py:547", "Resolved architecture: DeepseekV3ForCausalLM")
        log("INFO", "model.py:1510", f"Using max model len {cfg.max_model_len}")
        log("INFO", "scheduler.py:205", "Chunked prefill is enabled with max_num_batched_tokens=8192.")

    def stress_output(self) -> None:
        cfg = self.cfg
        if cfg.long_line:
            head = f"{prefix()}INFO {ts()} [tokenizer.py:101] long line: ".encode()
            if cfg.long_line <= len(head):
                head = b""
            left = cfg.long_line - len(head)
            write_all(1, head)
            chunk = b"L" * 65536
            while left > 0:
                write_all(1, chunk[: min(left, len(chunk))])
                left -= len(chunk)
            if not cfg.long_line_no_newline:
                write_all(1, b"\n")
        if cfg.invalid_utf8:
            head = f"{prefix()}WARNING {ts()} [tokenizer.py:88] ".encode()
            write_all(1, head + b"undecodable bytes: \xff\xfe \xc3\x28 \xed\xa0\x80 \xf0\x28\x8c\x28 end\n")
            write_all(2, b"\x80\x81 raw invalid bytes on stderr \xc0\xaf\n")
            head = f"{prefix()}INFO {ts()} [tokenizer.py:90] ".encode()
            write_all(1, head + b"split character: caf\xc3")
            time.sleep(0.01)
            write_all(1, b"\xa9 ok\n")

    def bind(self) -> None:
        """Bind now (as vLLM's setup_server does), listen only when ready."""
        cfg = self.cfg
        fam = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            sock.close()
            plain(traceback_lines(_API_BIND, f"OSError: [Errno {exc.errno}] {exc.strerror}"), important=True)
            self.exit(1)
        self.sock = sock

    def start_engine(self) -> None:
        cfg = self.cfg
        pause(0.05 * cfg.load_seconds)
        r, w = os.pipe()
        inherited = [] if cfg.children_inherit_socket or self.sock is None else [self.sock.fileno()]
        pid = fork_child("EngineCore_DP0", "VLLM::EngineCore", cfg, [r, *inherited])
        if pid == 0:
            engine_main(cfg, w)
        os.close(w)
        self.engine = pid
        self.ready_r = r

    def wait_engine_ready(self) -> None:
        while True:
            check()
            try:
                readable, _, _ = select.select([self.ready_r], [], [], 0.05)
            except InterruptedError:
                continue
            if not readable:
                continue
            data = os.read(self.ready_r, 64)
            if data == b"R":
                os.close(self.ready_r)
                return
            pause(0.05)  # a group-wide SIGTERM is not an engine failure
            reap([self.engine], 3.0)
            self.engine_reaped = True
            plain(traceback_lines(_API_INIT_FAILED, ROOT_CAUSE), important=True)
            self.exit(1)

    def stop_during_load(self, stop: _Stop) -> NoReturn:
        if stop.reason == "lifetime":
            self.cleanup()
            lifetime_exit([] if self.cfg.orphan_workers else [self.engine])
        self.stop_engine(graceful=True)
        plain(traceback_lines(_API_INTERRUPTED, "KeyboardInterrupt: terminated"), important=True)
        self.cleanup()
        # Python ends an uncaught KeyboardInterrupt by re-raising SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        os._exit(130)

    def ready(self) -> None:
        cfg = self.cfg
        P.quiet = False
        log(
            "INFO",
            "loggers.py:147",
            "Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 19290",
        )
        log("INFO", "api_server.py:1634", "Supported_tasks: ['generate']")
        if cfg.new_format:
            log("INFO", "api_server.py:602", f"Starting vLLM server on {self.url()}")
        else:
            log("INFO", "api_server.py:1912", f"Starting vLLM API server 0 on {self.url()}")
        lr, lroute = ("launcher.py:37", "launcher.py:46") if cfg.new_format else ("launcher.py:34", "launcher.py:42")
        log("INFO", lr, "Available routes are:")
        for route, methods in (
            ("/openapi.json", "GET, HEAD"),
            ("/docs", "GET, HEAD"),
            ("/docs/oauth2-redirect", "GET, HEAD"),
            ("/redoc", "GET, HEAD"),
            ("/health", "GET"),
            ("/load", "GET"),
            ("/ping", "POST"),
            ("/ping", "GET"),
            ("/tokenize", "POST"),
            ("/detokenize", "POST"),
            ("/v1/models", "GET"),
            ("/version", "GET"),
            ("/v1/responses", "POST"),
            ("/v1/chat/completions", "POST"),
            ("/v1/completions", "POST"),
            ("/metrics", "GET"),
        ):
            log("INFO", lroute, f"Route: {route}, Methods: {methods}")
        APP.cfg = cfg
        assert self.sock is not None
        srv = Server((cfg.host, cfg.port), Handler, bind_and_activate=False)
        srv.socket.close()
        srv.socket = self.sock
        srv.server_address = self.sock.getsockname()[:2]
        plain(f"INFO:     Started server process [{P.pid}]")
        plain("INFO:     Waiting for application startup.")
        plain("INFO:     Application startup complete.")
        srv.server_activate()  # listen(): connections are accepted from here on
        self.server = srv
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, name="uvicorn", daemon=True).start()
        install_term(cfg.ignore_sigterm)

    def close_http(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def serve(self) -> NoReturn:
        cfg = self.cfg
        t_ready = time.monotonic()
        next_stats = t_ready + cfg.stats_interval
        while True:
            try:
                pause(0.05, step=0.05)
            except _Stop as stop:
                if stop.reason == "lifetime":
                    self.cleanup()
                    lifetime_exit([] if cfg.orphan_workers else [self.engine])
                self.sigterm_shutdown()
            since = time.monotonic() - t_ready
            if self.engine_exited():
                self.engine_death()
            if cfg.hang_after_ready is not None and not APP.hung and since >= cfg.hang_after_ready:
                APP.hung = True
                P.quiet = True
            if cfg.unhealthy_after is not None and since >= cfg.unhealthy_after:
                APP.unhealthy = True
            if cfg.wedged_after is not None and not APP.wedged and since >= cfg.wedged_after:
                with APP.lock:
                    APP.wedged, APP.running = True, APP.running + 2
            if cfg.exit_after_ready is not None and since >= cfg.exit_after_ready:
                self.uvicorn_exit(cfg.exit_code)
            if cfg.stats_interval > 0 and time.monotonic() >= next_stats:
                next_stats += cfg.stats_interval
                log(
                    "INFO",
                    "loggers.py:123",
                    (
                        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                        "throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, "
                        "GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%"
                    ),
                )

    def sigterm_shutdown(self) -> NoReturn:
        """vLLM's SIGTERM handler cancels uvicorn, then shuts the engine down."""
        log("INFO", "launcher.py:101", "Shutting down FastAPI HTTP server.")
        plain("INFO:     Shutting down")
        self.close_http()
        time.sleep(self.cfg.stop_delay)
        plain("INFO:     Waiting for application shutdown.")
        plain("INFO:     Application shutdown complete.")
        self.stop_engine(graceful=True)
        self.exit(0)

    def uvicorn_exit(self, code: int) -> NoReturn:
        """uvicorn's own should_exit path (watchdog, --exit-after-ready)."""
        plain("INFO:     Shutting down")
        self.close_http()
        plain("INFO:     Waiting for application shutdown.")
        plain("INFO:     Application shutdown complete.")
        plain(f"INFO:     Finished server process [{P.pid}]")
        self.stop_engine(graceful=True)
        self.exit(code)

    def engine_death(self) -> NoReturn:
        with contextlib.suppress(_Stop):
            pause(0.05)
        if P.stop_requested:
            self.sigterm_shutdown()
        APP.engine_dead = True
        log("ERROR", "core_client.py:564", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
        try:
            pause(self.cfg.engine_death_exit_delay)
        except _Stop:
            self.sigterm_shutdown()
        self.uvicorn_exit(self.cfg.engine_death_exit_code)


def flood(cfg: Config) -> None:
    """Print cfg.flood_lines numbered log lines as fast as possible."""
    fds = {"stdout": [1], "stderr": [2], "both": [1, 2]}[cfg.flood_stream]
    pre = f"{prefix()}INFO "
    chunk: list[str] = []
    size = 0
    which = 0
    stamp = ts()
    for i in range(cfg.flood_lines):
        if i % 4096 == 0:
            stamp = ts()
        head = f"{pre}{stamp} [loggers.py:123] flood line {i:09d} "
        pad = max(0, cfg.flood_line_bytes - len(head) - 1)
        line = head + "x" * pad + "\n"
        chunk.append(line)
        size += len(line)
        if size >= 65536:
            write_all(fds[which % len(fds)], "".join(chunk).encode())
            which += 1
            chunk, size = [], 0
    if chunk:
        write_all(fds[which % len(fds)], "".join(chunk).encode())


def main(argv: Sequence[str] | None = None) -> NoReturn:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    Main(cfg).run()


if __name__ == "__main__":
    main()
