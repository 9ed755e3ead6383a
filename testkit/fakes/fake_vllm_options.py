"""The fake vLLM's command line: vLLM's own flags it uses, and the flags that pick a behaviour.

Only flags a test, bench or the demo profile passes are here (grep for a flag before removing it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    model: str
    served_name: str
    host: str
    port: int
    tp: int
    max_model_len: int
    gpu_util: float
    # timings
    load_seconds: float
    shards: int
    hold_load_until: str | None
    max_lifetime: float
    # failures while loading
    crash_during_load: bool
    free_memory_error: bool
    # failures after ready
    hang_after_ready: float | None
    hang_when: str | None
    unhealthy_after: float | None
    trickle_health_after: float | None
    wedged_after: float | None
    wedged_after_answers: int | None
    exit_after_ready: float | None
    exit_code: int
    kill_worker_after_ready: float | None
    engine_death_exit_delay: float
    # signals and the process tree
    ignore_sigterm: bool
    ignore_sigterm_during_load: bool
    orphan_workers: bool
    worker_setsid: bool
    # output stress
    flood_lines: int
    flood_only: bool
    flood_line_bytes: int
    long_line: int
    long_line_no_newline: bool
    invalid_utf8: bool
    silent_load: bool
    # names of environment variables to print at start, as this process got them (tests of the child's env)
    print_env: tuple[str, ...] = ()
    uds: str | None = None  # --uds PATH: serve on this Unix socket, not on host:port


# vLLM options that take a value, declared (and ignored) so that their value is never taken for the
# positional MODEL: the ones our configs and tests pass.
_IGNORED_VALUE_FLAGS = (
    "--dtype",
    "--api-key",
    "--tool-call-parser",
    "--reasoning-parser",
    "--chat-template",
    "--kv-cache-dtype",
    "--quantization",
)

_DESCRIPTION = """\
Fake `vllm serve`: same argv shape as real vLLM, stdlib only, output replayed from vLLM 0.32 logs.

Normal start (about --load-seconds): the APIServer binds (no listen) the port and forks EngineCore,
which forks the TP workers; worker 0 prints the safetensors progress; when every worker is ready the
APIServer prints "Starting vLLM server on http://HOST:PORT" and starts listening. SIGTERM/SIGINT after
that: shutdown lines, children stopped, exit 0. During load: KeyboardInterrupt traceback, children
stopped, then the process kills itself with SIGINT (Python's end for an uncaught KeyboardInterrupt).
"""

_EPILOG = """\
Other vLLM flags are accepted and ignored; a leading `serve` is optional. Exit codes (main process):
0 clean shutdown, --flood-only, engine death; 1 engine start failure or port bind failure; killed by
SIGINT after SIGTERM/SIGINT during load; 3 when --max-lifetime expires; --exit-code C with
--exit-after-ready.
"""


# The "failures after ready" options: each takes S, the seconds after ready when the failure starts.
AFTER_READY = (
    ("--hang-after-ready", "HTTP requests never answered, output stops"),
    ("--unhealthy-after", "/health answers 503"),
    ("--trickle-health-after", "/health sends its 200 response one byte every 0.5 s (a per-recv timeout never trips)"),
    (
        "--wedged-after",
        "the engine wedges (GPU page fault, NCCL hang): /health stays 200, completions are never answered, "
        "/metrics freezes with 2 requests running (plus the hung ones) and generation_tokens_total still",
    ),
    ("--exit-after-ready", "uvicorn shuts down, exit --exit-code"),
    ("--kill-worker-after-ready", "EngineCore SIGKILLs worker 0 and dies; exit 0"),
)


def _int_with_suffix(text: str) -> int:
    """vLLM-style sizes such as 131072, 128k, 1M."""
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fake_vllm.py serve",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_tag", nargs="?", default=None, help="as in `vllm serve MODEL` (need not exist)")
    v = p.add_argument_group("vLLM options the fake uses")
    v.add_argument("--model", default=None, help="same as MODEL")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    # vLLM's API server on a Unix socket instead of host:port (entrypoints/launchers/launcher.py): bound as it is.
    v.add_argument("--uds", default=None)
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp", help="worker processes")
    v.add_argument("--served-model-name", nargs="+", default=None, help="model id of /v1/models and completions")
    v.add_argument("--max-model-len", type=_int_with_suffix, default=131072, help="reported by /v1/models")
    v.add_argument("--gpu-memory-utilization", type=float, default=0.9, dest="gpu_util", help="for --free-memory-error")
    for flag in _IGNORED_VALUE_FLAGS:
        p.add_argument(flag, dest="ignored" + flag.replace("-", "_"), help=argparse.SUPPRESS)

    t = p.add_argument_group("timings")
    t.add_argument("--load-seconds", type=float, default=1.0, metavar="F", help="start to listening (default 1)")
    t.add_argument("--shards", type=int, default=8, metavar="K", help="safetensors shards = progress steps")
    t.add_argument(
        "--hold-load-until",
        default=None,
        metavar="FILE",
        help="every worker stops after the first shard until FILE exists (a test sees the loading phase, then lets go)",
    )
    t.add_argument(
        "--max-lifetime",
        type=float,
        default=300.0,
        metavar="S",
        help="safety net: every fake process exits (code 3) after S seconds whatever its mode (0 = never)",
    )

    load = p.add_argument_group("failures while loading")
    load.add_argument("--crash-during-load", action="store_true", help="worker 0: CUDA OOM half-way through the shards")
    load.add_argument("--free-memory-error", action="store_true", help="worker 0: 'Free memory on device' at init")

    after = p.add_argument_group("failures after ready (S = seconds after ready)")
    for flag, what in AFTER_READY:  # each a failure that starts S seconds after ready
        after.add_argument(flag, type=float, metavar="S", help=what)
    after.add_argument(
        "--hang-when",
        default=None,
        metavar="FILE",
        help="as --hang-after-ready, once FILE exists (an event the test makes, not a time: a loaded machine's "
        "supervisor may see ready late)",
    )
    after.add_argument(
        "--wedged-after-answers",
        type=int,
        metavar="N",
        help="as --wedged-after, once N completions were answered (an event, not a time: a loaded machine's "
        "probes may come late)",
    )
    after.add_argument("--exit-code", type=int, default=0, metavar="C")
    after.add_argument(
        "--engine-death-exit-delay",
        type=float,
        default=0.5,
        metavar="F",
        help="503s between engine death and the main process exiting (vLLM: up to 5 s)",
    )

    s = p.add_argument_group("signals and the process tree")
    s.add_argument("--ignore-sigterm", action="store_true", help="every process ignores SIGTERM/SIGINT/SIGHUP")
    s.add_argument("--ignore-sigterm-during-load", action="store_true", help="the same, until ready")
    s.add_argument(
        "--orphan-workers",
        action="store_true",
        help="EngineCore and workers outlive their parent and nobody signals its children",
    )
    s.add_argument("--worker-setsid", action="store_true", help="workers leave the session and process group")

    o = p.add_argument_group("output stress")
    o.add_argument("--flood-lines", type=int, default=0, metavar="N", help="N log lines at once at startup")
    o.add_argument("--flood-only", action="store_true", help="print the flood and exit 0 (no processes, no port)")
    o.add_argument("--flood-line-bytes", type=int, default=120, metavar="B", help="flood line length incl. newline")
    o.add_argument("--long-line", type=int, default=0, metavar="BYTES", help="one stdout line of BYTES bytes")
    o.add_argument("--long-line-no-newline", action="store_true", help="the next log line continues --long-line")
    o.add_argument("--invalid-utf8", action="store_true", help="invalid UTF-8, and a character split across writes")
    o.add_argument("--silent-load", action="store_true", help="print nothing (errors excepted) until ready")
    o.add_argument(
        "--print-env",
        action="append",
        default=[],
        metavar="NAME",
        help="print `fake-vllm env NAME=VALUE` (or `NAME unset`) at start, from this process's own environment",
    )
    return p


def parse_config(argv: Sequence[str]) -> Config:
    args = list(argv)
    if args and args[0] == "serve":
        args = args[1:]
    ns, _unknown = build_parser().parse_known_args(args)
    model = str(ns.model_tag or ns.model or "/models/fake-model")
    return Config(
        model=model,
        served_name=str(ns.served_model_name[0]) if ns.served_model_name else model,
        host=str(ns.host),
        port=int(ns.port),
        tp=max(1, int(ns.tp)),
        max_model_len=int(ns.max_model_len),
        gpu_util=float(ns.gpu_util),
        load_seconds=max(0.0, float(ns.load_seconds)),
        shards=max(1, int(ns.shards)),
        hold_load_until=ns.hold_load_until,
        max_lifetime=max(0.0, float(ns.max_lifetime)),
        crash_during_load=bool(ns.crash_during_load),
        free_memory_error=bool(ns.free_memory_error),
        hang_after_ready=ns.hang_after_ready,
        hang_when=ns.hang_when,
        unhealthy_after=ns.unhealthy_after,
        trickle_health_after=ns.trickle_health_after,
        wedged_after=ns.wedged_after,
        wedged_after_answers=ns.wedged_after_answers,
        exit_after_ready=ns.exit_after_ready,
        exit_code=int(ns.exit_code),
        kill_worker_after_ready=ns.kill_worker_after_ready,
        engine_death_exit_delay=max(0.0, float(ns.engine_death_exit_delay)),
        ignore_sigterm=bool(ns.ignore_sigterm),
        ignore_sigterm_during_load=bool(ns.ignore_sigterm_during_load),
        orphan_workers=bool(ns.orphan_workers),
        worker_setsid=bool(ns.worker_setsid),
        flood_lines=max(0, int(ns.flood_lines)),
        flood_only=bool(ns.flood_only),
        flood_line_bytes=max(1, int(ns.flood_line_bytes)),
        long_line=max(0, int(ns.long_line)),
        long_line_no_newline=bool(ns.long_line_no_newline),
        invalid_utf8=bool(ns.invalid_utf8),
        silent_load=bool(ns.silent_load),
        print_env=tuple(ns.print_env),
        uds=ns.uds,
    )
