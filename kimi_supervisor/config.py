"""Configuration: one TOML file parsed by pure functions into frozen dataclasses.

Validation happens here, once, when the config is built: every later module
can trust its values.  Every problem becomes a one-line `ConfigError` naming
the file, the dotted key and what was expected; nothing here exits.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kimi_supervisor.configfile import read_config_bytes
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.vllm_args import VllmArgs, parse_vllm_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_PATH = Path("/etc/kimi-supervisor/kimi-supervisor.toml")

# The defaults match vLLM's own entry points, never a mere "vllm" somewhere in an argument
# (`python3 eval.py --output-dir /data/vllm-eval` is someone else's job): the titles vLLM gives
# its processes (setproctitle; the kernel keeps 15 characters in comm), `vllm serve` run
# directly or through its console script, and `python -m vllm.entrypoints...`.  Each regex is
# anchored at argv[0], so a wrapper whose argv merely contains such a command line (runuser,
# sudo, tmux, `bash -c`) never matches.  README, "Kill rules", lists what does and does not match.
DEFAULT_REAP_NAMES = ("VLLM::*",)
_PYTHON = r"^(\S*/)?python[0-9.]*( -[WX] \S+| -[^ cm]\S*)*"
DEFAULT_REAP_CMDLINE = (
    r"^(\S*/)?vllm serve( |$)",
    _PYTHON + r" (\S*/)?vllm serve( |$)",
    _PYTHON + r" -m vllm\.entrypoints(\.\S+)?( |$)",
    _PYTHON + r" -m vllm serve( |$)",
)
# Companions hold no CUDA context; they die only with a reaped holder's tree.
DEFAULT_REAP_COMPANIONS = (r"multiprocessing\.resource_tracker",)
DEFAULT_PROTECTED = (
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgm*",
    "dcgm-exporter",
    "nvidia-smi",
    "systemd",
    "init",
    "sshd",
)
DEFAULT_STARTED_PATTERNS = (
    r"Application startup complete\.",
    r"Starting vLLM server on ",
    r"Starting vLLM API server( \d+)? on ",
)
DEFAULT_FATAL_PATTERNS = (
    r"Engine core initialization failed",
    r"Free memory on device .* is less than desired GPU memory utilization",
    r"died unexpectedly",
    r"EngineCore encountered a fatal error",
    r"EngineDeadError",
    r"CUDA out of memory",
)


@dataclasses.dataclass(frozen=True)
class SpawnSpec:
    """What spawning the child needs (child.ChildProcess.spawn); ChildConfig adds what only vLLM has."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    inherit_environment: bool
    working_directory: str | None
    user: str | None
    # Resolved to a gid, with the user's supplementary groups, when the child is spawned (spawnuser.py).
    group: str | None = None


@dataclasses.dataclass(frozen=True)
class ChildConfig(SpawnSpec):
    vllm: VllmArgs = dataclasses.field(kw_only=True)


@dataclasses.dataclass(frozen=True)
class ReapConfig:
    enabled: bool
    grace_s: float
    names: tuple[str, ...]
    cmdline: tuple[re.Pattern[str], ...]
    companions: tuple[re.Pattern[str], ...]
    protected_names: tuple[str, ...]
    # Only processes of these users may be reaped: root and child.user by default.
    users: tuple[str, ...] = ("root",)


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    enabled: bool
    directory: Path
    globs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PreflightConfig:
    # None: every GPU NVML sees.  (): no GPU at all (CPU deployments, demo).
    gpus: tuple[int, ...] | None
    memory_threshold_mib: int
    poll_interval_s: float
    deadline_s: float
    busy_log_interval_s: float
    check_model: bool
    check_port: bool
    reap: ReapConfig
    shm: ShmConfig


@dataclasses.dataclass(frozen=True)
class ReadinessConfig:
    started_patterns: tuple[re.Pattern[str], ...]
    fatal_patterns: tuple[re.Pattern[str], ...]
    health_url: str
    deadline_s: float
    stall_timeout_s: float
    poll_interval_s: float


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    interval_s: float
    timeout_s: float
    failures_tolerated: int


@dataclasses.dataclass(frozen=True)
class ShutdownConfig:
    grace_s: float
    second_signal_grace_s: float
    gpu_release_timeout_s: float


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    # The unit's RuntimeDirectory= (lock, live state) and StateDirectory= (run history).
    runtime_directory: Path
    state_directory: Path


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # node_exporter's textfile collector reads *.prom files; None: no metrics file.
    textfile: Path | None


@dataclasses.dataclass(frozen=True)
class LivenessConfig:
    # Deep liveness (liveness.py): /health stays 200 while an engine is wedged.
    canary_interval_s: float  # 0: no canary
    canary_timeout_s: float
    failures_tolerated: int
    when: str  # "idle": only while /metrics shows nothing in flight; "always"
    stuck_after_s: float  # 0: no token-progress check
    metrics_interval_s: float
    metrics_url: str  # /v1/completions and the model name come from child.argv (child.vllm)


GPU_HEALTH_POLICIES = ("fail", "warn", "off")


@dataclasses.dataclass(frozen=True)
class GpuHealthConfig:
    xid_events: bool  # watch NVML XID / double-bit ECC events while serving
    xid_ignored: tuple[int, ...]  # logged, not acted on
    # Preflight checks (gpu_health.py): what a problem found by each one is.
    retired_pages: str
    remapped_rows: str
    ecc_uncorrected: str
    pcie_link: str
    persistence_mode: str
    clock_events: str


@dataclasses.dataclass(frozen=True)
class Config:
    path: Path
    child: ChildConfig
    preflight: PreflightConfig
    readiness: ReadinessConfig
    health: HealthConfig
    shutdown: ShutdownConfig
    paths: PathsConfig
    metrics: MetricsConfig
    liveness: LivenessConfig
    gpu_health: GpuHealthConfig


_T = TypeVar("_T")
_MISSING = object()


# Shortest accepted interval or timeout: 1e-300 would make a poll loop spin a core.
MIN_SECONDS = 0.01


def _describe(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    name = kind.get(type(value), type(value).__name__)
    shown = _short_repr(value) if not isinstance(value, (list, dict)) else ""
    return f"{name} {shown}".strip()


def _short_repr(value: object, limit: int = 80) -> str:
    if isinstance(value, int) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length()} bits>"  # repr() of a 5000-digit int raises
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def _show_name(name: str) -> str:
    # TOML quoted keys may hold anything (spaces, newlines, 1 MiB): show those quoted and short.
    return name if re.fullmatch(r"[A-Za-z0-9_.\[\]-]{1,80}", name) else _short_repr(name, 40)


class _Table:
    """One TOML table being read: typed getters, then `done()` rejects leftovers."""

    def __init__(self, raw: Mapping[str, Any], prefix: str, file: Path) -> None:
        self._raw = raw
        self._prefix = prefix
        self._file = file
        self._seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self._prefix}{_show_name(name)}"

    def error(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"{self._file}: {self.key(name)}: {message}")

    def _get(self, name: str, default: object) -> object:
        self._seen.add(name)
        value = self._raw.get(name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(name, "required key is missing")
            return default
        return value

    def _typed(self, name: str, default: object, check: Callable[[object], bool], expected: str) -> object:
        value = self._get(name, default)
        if value is not default and not check(value):
            raise self.error(name, f"expected {expected}, got {_describe(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return bool(self._typed(name, default, lambda v: isinstance(v, bool), "true or false"))

    def number(self, name: str, default: float, *, maximum: float = 1e9, zero_ok: bool = False) -> float:
        """Seconds: at least MIN_SECONDS (or exactly 0 where `zero_ok` means "skip"), at most `maximum`."""

        def ok(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        value = float(self._typed(name, default, ok, "a number of seconds" if name.endswith("_s") else "a number"))  # type: ignore[arg-type]
        if not (value == 0 and zero_ok) and not MIN_SECONDS <= value <= maximum:
            bound = f"0 or a value >= {MIN_SECONDS:g}" if zero_ok else f"a value >= {MIN_SECONDS:g}"
            raise self.error(name, f"expected {bound} and <= {maximum:g}, got {value:g}")
        return value

    def integer(self, name: str, default: int, *, minimum: int, maximum: int) -> int:
        value = self._typed(name, default, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
        assert isinstance(value, int)
        if not minimum <= value <= maximum:
            raise self.error(name, f"expected an integer between {minimum} and {maximum}, got {value}")
        return value

    def string(self, name: str, default: object) -> str | None:
        value = self._typed(name, default, lambda v: isinstance(v, str), "a string")
        return value if isinstance(value, str) else None

    def strings(self, name: str, default: object, *, non_empty: bool = False) -> tuple[str, ...]:
        def ok(v: object) -> bool:
            return isinstance(v, list) and all(isinstance(x, str) for x in v)

        value = self._typed(name, default, ok, "an array of strings")
        result = tuple(value) if isinstance(value, (list, tuple)) else ()
        if non_empty and not result:
            raise self.error(name, "expected a non-empty array of strings, got an empty array")
        return result

    def patterns(self, name: str, default: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
        compiled = []
        for text in self.strings(name, list(default)):
            try:
                compiled.append(re.compile(text))
            except re.error as exc:
                raise self.error(name, f"invalid regular expression {text!r}: {exc}") from None
        return tuple(compiled)

    def table(self, name: str) -> _Table:
        value = self._typed(name, {}, lambda v: isinstance(v, dict), "a table")
        assert isinstance(value, dict)
        return _Table(value, self.key(name) + ".", self._file)

    def raw(self, name: str, default: object) -> object:
        return self._get(name, default)

    def done(self) -> None:
        for name in self._raw:
            if name not in self._seen:
                close = difflib.get_close_matches(name, sorted(self._seen), n=1, cutoff=0.75)
                hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(self._seen))})"
                raise self.error(name, f"unknown key{hint}")


def _parse_child(t: _Table) -> ChildConfig:
    argv = t.strings("argv", _MISSING, non_empty=True)
    if not argv[0].strip():
        raise t.error("argv", "argv[0] must name the program to run, got an empty string")
    for i, arg in enumerate(argv):
        # execve() takes C strings: a NUL would fail only at spawn, after the preflight killed things.
        if "\0" in arg:
            raise t.error(f"argv[{i}]", f"contains a NUL byte: {_short_repr(arg)}")
    env_table = t.raw("env", {})
    if not isinstance(env_table, dict):
        raise t.error("env", f"expected a table of strings, got {_describe(env_table)}")
    for key, value in env_table.items():
        if not key or "=" in key or "\0" in key:
            raise t.error("env", f"invalid variable name {_short_repr(key)}: it must be non-empty, without '=' or NUL")
        if not isinstance(value, str):
            raise t.error(f"env.{key}", f"expected a string, got {_describe(value)}")
        if "\0" in value:
            raise t.error(f"env.{key}", "contains a NUL byte")
    inherit = t.boolean("inherit_environment", True)
    cwd = t.string("working_directory", None)
    if cwd is not None and (not cwd.startswith("/") or "\0" in cwd):
        raise t.error("working_directory", f"expected an absolute path, got {_short_repr(cwd)}")
    user = _account_name(t, "user")
    group = _account_name(t, "group")
    if group is not None and user is None:
        raise t.error("group", "is set without child.user: the child would keep root's user with another group")
    try:
        vllm = parse_vllm_args(argv)
    except ValueError as exc:
        raise t.error("argv", str(exc)) from None
    t.done()
    return ChildConfig(tuple(argv), dict(env_table), inherit, cwd, user, group, vllm=vllm)


def _account_name(t: _Table, name: str) -> str | None:
    """A user or group name (or numeric id); whether it exists is checked on the host, before the preflight."""
    value = t.string(name, None)
    if value is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.@-]{0,255}\$?", value):
        raise t.error(name, f"expected a {name} name or numeric id, got {_short_repr(value)}")
    return value


def _parse_gpus(t: _Table) -> tuple[int, ...] | None:
    value = t.raw("gpus", "all")
    if value == "all":
        return None
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1024 for x in value):
        if len(set(value)) != len(value):
            raise t.error("gpus", f"expected distinct GPU indices, got {value}")
        return tuple(value)
    raise t.error("gpus", f'expected "all" or an array of GPU indices (e.g. [0, 1]), got {_describe(value)}')


def _reap_users(r: _Table, child_user: str | None) -> tuple[str, ...]:
    default = ["root"] + ([child_user] if child_user and child_user != "root" else [])
    users = r.strings("users", default)
    if not users:
        raise r.error("users", "expected at least one user name (an empty list would mean nobody, not everyone)")
    for name in users:
        if not name.strip():
            raise r.error("users", f"expected user names, got {name!r}")
    return users


def _parse_preflight(t: _Table, child_user: str | None = None) -> PreflightConfig:
    gpus = _parse_gpus(t)
    threshold = t.integer("memory_threshold_mib", 1000, minimum=0, maximum=1 << 24)
    poll = t.number("poll_interval_s", 0.25, maximum=60)
    deadline = t.number("deadline_s", 30.0, maximum=86400, zero_ok=True)
    busy_log = t.number("busy_log_interval_s", 5.0, maximum=3600)
    check_model = t.boolean("check_model", True)
    check_port = t.boolean("check_port", True)
    r = t.table("reap")
    reap = ReapConfig(
        enabled=r.boolean("enabled", True),
        grace_s=r.number("grace_s", 10.0, maximum=600),
        names=r.strings("names", list(DEFAULT_REAP_NAMES)),
        cmdline=r.patterns("cmdline", DEFAULT_REAP_CMDLINE),
        companions=r.patterns("companions", DEFAULT_REAP_COMPANIONS),
        protected_names=r.strings("protected_names", list(DEFAULT_PROTECTED)),
        users=_reap_users(r, child_user),
    )
    r.done()
    s = t.table("shm")
    directory = s.string("directory", "/dev/shm") or "/dev/shm"
    if not directory.startswith("/"):
        raise s.error("directory", f"expected an absolute path, got {directory!r}")
    globs = s.strings("globs", ["psm_*", "sem.mp-*", "nccl-*"])
    for glob in globs:
        if "/" in glob or glob.strip("*?") == "":
            raise s.error("globs", f"expected file-name globs with a fixed part and no '/', got {glob!r}")
    shm = ShmConfig(enabled=s.boolean("enabled", True), directory=Path(directory), globs=globs)
    s.done()
    t.done()
    return PreflightConfig(gpus, threshold, poll, deadline, busy_log, check_model, check_port, reap, shm)


def _parse_readiness(t: _Table, vllm: VllmArgs) -> ReadinessConfig:
    url = t.string("health_url", "") or vllm.health_url
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise t.error("health_url", f"expected an http:// or https:// URL, got {url!r}")
    cfg = ReadinessConfig(
        started_patterns=t.patterns("started_patterns", DEFAULT_STARTED_PATTERNS),
        fatal_patterns=t.patterns("fatal_patterns", DEFAULT_FATAL_PATTERNS),
        health_url=url,
        deadline_s=t.number("deadline_s", 1800.0, maximum=7 * 86400),
        stall_timeout_s=t.number("stall_timeout_s", 300.0, maximum=86400),
        poll_interval_s=t.number("poll_interval_s", 0.25, maximum=60),
    )
    if not cfg.started_patterns:
        raise t.error("started_patterns", "expected at least one pattern, got an empty array")
    t.done()
    return cfg


def _parse_health(t: _Table) -> HealthConfig:
    cfg = HealthConfig(
        interval_s=t.number("interval_s", 5.0, maximum=3600),
        timeout_s=t.number("timeout_s", 3.0, maximum=600),
        failures_tolerated=t.integer("failures_tolerated", 3, minimum=1, maximum=1000),
    )
    t.done()
    return cfg


def _parse_shutdown(t: _Table) -> ShutdownConfig:
    cfg = ShutdownConfig(
        grace_s=t.number("grace_s", 30.0, maximum=3600),
        second_signal_grace_s=t.number("second_signal_grace_s", 2.0, maximum=3600, zero_ok=True),
        gpu_release_timeout_s=t.number("gpu_release_timeout_s", 30.0, maximum=3600, zero_ok=True),
    )
    t.done()
    return cfg


def _parse_paths(t: _Table) -> PathsConfig:
    def absolute(name: str, default: str) -> Path:
        value = t.string(name, default) or default
        if not value.startswith("/"):
            raise t.error(name, f"expected an absolute path, got {value!r}")
        return Path(value)

    cfg = PathsConfig(
        runtime_directory=absolute("runtime_directory", "/run/kimi-supervisor"),
        state_directory=absolute("state_directory", "/var/lib/kimi-supervisor"),
    )
    t.done()
    return cfg


def _parse_metrics(t: _Table) -> MetricsConfig:
    value = t.string("textfile", None)
    if value is not None and not (value.startswith("/") and value.endswith(".prom")):
        raise t.error(
            "textfile", f"expected an absolute path ending in .prom (node_exporter reads only *.prom), got {value!r}"
        )
    t.done()
    return MetricsConfig(Path(value) if value else None)


def _parse_liveness(t: _Table, vllm: VllmArgs) -> LivenessConfig:
    when = t.string("when", "idle")
    if when not in ("idle", "always"):
        raise t.error("when", f'expected "idle" or "always", got {when!r}')
    metrics_url = t.string("metrics_url", "") or vllm.api_url("/metrics")
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", metrics_url):
        raise t.error("metrics_url", f"expected an http:// or https:// URL, got {metrics_url!r}")
    cfg = LivenessConfig(
        canary_interval_s=t.number("canary_interval_s", 60.0, maximum=86400, zero_ok=True),
        canary_timeout_s=t.number("canary_timeout_s", 10.0, maximum=600),
        failures_tolerated=t.integer("failures_tolerated", 2, minimum=1, maximum=1000),
        when=when or "idle",
        stuck_after_s=t.number("stuck_after_s", 120.0, maximum=86400, zero_ok=True),
        metrics_interval_s=t.number("metrics_interval_s", 5.0, maximum=3600),
        metrics_url=metrics_url,
    )
    if 0 < cfg.stuck_after_s < 2 * cfg.metrics_interval_s:
        raise t.error(
            "stuck_after_s",
            f"expected 0 (off) or at least 2 x liveness.metrics_interval_s ({2 * cfg.metrics_interval_s:g}), "
            f"got {cfg.stuck_after_s:g}",
        )
    t.done()
    return cfg


def _parse_gpu_health(t: _Table) -> GpuHealthConfig:
    def policy(name: str, default: str) -> str:
        value = t.string(name, default)
        if value not in GPU_HEALTH_POLICIES:
            raise t.error(name, f'expected "fail", "warn" or "off", got {value!r}')
        return value

    ignored = t.raw("xid_ignored", [63, 92])
    if not isinstance(ignored, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ignored):
        raise t.error("xid_ignored", f"expected an array of XID numbers, got {_describe(ignored)}")
    cfg = GpuHealthConfig(
        xid_events=t.boolean("xid_events", True),
        xid_ignored=tuple(ignored),
        retired_pages=policy("retired_pages", "fail"),
        remapped_rows=policy("remapped_rows", "fail"),
        ecc_uncorrected=policy("ecc_uncorrected", "fail"),
        pcie_link=policy("pcie_link", "warn"),
        persistence_mode=policy("persistence_mode", "warn"),
        clock_events=policy("clock_events", "warn"),
    )
    t.done()
    return cfg


def parse_config(data: Mapping[str, Any], path: Path) -> Config:
    """Build a Config from parsed TOML; raises ConfigError naming file and key."""
    root = _Table(data, "", path)
    if not data:
        raise ConfigError(f"{path}: the file is empty; required key 'child.argv' is missing")
    child = _parse_child(root.table("child"))
    preflight = _parse_preflight(root.table("preflight"), child.user)
    readiness = _parse_readiness(root.table("readiness"), child.vllm)
    health = _parse_health(root.table("health"))
    shutdown = _parse_shutdown(root.table("shutdown"))
    paths = _parse_paths(root.table("paths"))
    metrics = _parse_metrics(root.table("metrics"))
    liveness = _parse_liveness(root.table("liveness"), child.vllm)
    gpu_health = _parse_gpu_health(root.table("gpu_health"))
    root.done()
    return Config(path, child, preflight, readiness, health, shutdown, paths, metrics, liveness, gpu_health)


def load_config(path: Path) -> Config:
    """Read (configfile.py: regular file, size cap, StrictModes as root) and validate the TOML file."""
    raw = read_config_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 at byte {exc.start}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib ends its message with "(at line L, column C)"; keep one line.
        raise ConfigError(f"{path}: invalid TOML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None
    except Exception as exc:  # whatever the parser trips on (MemoryError aside) is the file's fault
        raise ConfigError(f"{path}: invalid TOML: {type(exc).__name__}: {str(exc)[:200]}") from None
    return parse_config(data, path)


def effective_config(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for check-config); secrets are redacted by the caller."""

    def plain(value: object) -> object:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, re.Pattern):
            return value.pattern
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Path):
            return str(value)
        return value

    result = plain(cfg)
    assert isinstance(result, dict)
    return result
