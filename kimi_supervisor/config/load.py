"""Configuration: one TOML file parsed by pure functions into frozen dataclasses (config/model.py).

Validation happens here, once, when the config is built: every later module
can trust its values.  Every problem becomes a one-line `ConfigError` naming
the file, the dotted key and what was expected (config/table.py reads each
table); nothing here exits.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kimi_supervisor.config import role_spec, spare
from kimi_supervisor.config.cluster import GroupNode, apply_cluster, parse_cluster
from kimi_supervisor.config.file import read_config_bytes
from kimi_supervisor.config.front import FrontConfig, parse_front
from kimi_supervisor.config.gpu_pinning import PinningError, pinned_env, ras_env
from kimi_supervisor.config.model import (
    GPU_HEALTH_POLICIES,
    ChildConfig,
    Config,
    DeploymentConfig,
    FatalRule,
    GpuHealthConfig,
    HealthConfig,
    LivenessConfig,
    MetricsConfig,
    PathsConfig,
    PreflightConfig,
    ReadaheadConfig,
    ReadinessConfig,
    ReapConfig,
    ShmConfig,
    ShutdownConfig,
    SpareConfig,
    WeightsConfig,
)
from kimi_supervisor.config.table import MISSING, Table, describe, short_repr
from kimi_supervisor.config.vllm_args import VllmArgs, parse_vllm_args
from kimi_supervisor.config.vllm_yaml import expand
from kimi_supervisor.config.weights import WeightsArgError, socket_dir
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.roles import ROLE_NAMES, Role

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
# sudo, tmux, `bash -c`) never matches.  docs/kill-safety.md, "Kill rules", lists what does and does not match.
DEFAULT_REAP_NAMES = ("VLLM::*",)
_PYTHON = r"^(\S*/)?python[0-9.]*( -[WX] \S+| -[^ cm]\S*)*"
DEFAULT_REAP_CMDLINE = (
    r"^(\S*/)?vllm serve( |$)",
    _PYTHON + r" (\S*/)?vllm serve( |$)",
    # The holder (docs/weight-holder.md): stale like any vLLM tree once its supervisor is gone; a live one's tree is
    # spared as every live supervisor's is (reaper.LiveTrees).  Its per-GPU daemons are its spawn children.
    r"^(\S*/)?vllm preload( |$)",
    _PYTHON + r" (\S*/)?vllm preload( |$)",
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
# `file.py: message start`: the vLLM 0.32 record that says the engine is gone, each from the file that logs it
# (vllm/v1/...; checked against tests/fixtures/vllm_cpu_0.32).  A CUDA OOM, "Free memory on device" or
# "Engine core initialization failed" is no rule of its own: the worker or engine record that fails on it
# ("WorkerProc failed to start.", "EngineCore encountered a fatal error.") is, and the OOM line is quoted as
# the root cause.  Never a bare word: client text (a model name, a prompt) lands in ERROR records too.
DEFAULT_FATAL_PATTERNS = (
    r"core.py: EngineCore failed to start\.",  # v1/engine/core.py, logger.exception while starting
    r"core.py: EngineCore encountered a fatal error\.",  # v1/engine/core.py, the busy loop died
    r"multiproc_executor.py: Worker proc \S+ died unexpectedly",  # v1/executor/multiproc_executor.py, monitor
    r"multiproc_executor.py: WorkerProc failed to start\.",  # the worker, while loading
    r"multiproc_executor.py: WorkerProc failed\.$",  # the worker's busy loop died
    r"ray_executor_v2.py: RayWorkerProc rank=.* died unexpectedly",  # v1/executor/ray_executor_v2.py
    r"async_llm.py: AsyncLLM output_handler failed\.",  # v1/engine/async_llm.py: the API server lost its engine
)
_FATAL_RULE = re.compile(r"^(?P<source>[A-Za-z0-9_.-]+\.py): (?P<message>.+)$", re.DOTALL)


def _fatal_rules(t: Table) -> tuple[FatalRule, ...]:
    rules = []
    for i, text in enumerate(t.strings("fatal_patterns", list(DEFAULT_FATAL_PATTERNS))):
        m = _FATAL_RULE.match(text)
        if m is None:
            raise t.error(
                f"fatal_patterns[{i}]",
                f"{short_repr(text)} names no source: write 'file.py: message start' (the file in vLLM's "
                "[file.py:line] header, e.g. 'multiproc_executor.py: Worker proc \\S+ died unexpectedly'); "
                "a bare pattern would match client text that vLLM logs",
            )
        try:
            message = re.compile(m.group("message"))
        except re.error as exc:
            raise t.error(f"fatal_patterns[{i}]", f"invalid regular expression {short_repr(text)}: {exc}") from None
        rules.append(FatalRule(m.group("source"), message, text))
    return tuple(rules)


def _parse_child(t: Table) -> ChildConfig:
    argv = t.strings("argv", MISSING, non_empty=True)
    if not argv[0].strip():
        raise t.error("argv", "argv[0] must name the program to run, got an empty string")
    for i, arg in enumerate(argv):
        # execve() takes C strings: a NUL would fail only at spawn, after the preflight killed things.
        if "\0" in arg:
            raise t.error(f"argv[{i}]", f"contains a NUL byte: {short_repr(arg)}")
    env_table = t.raw("env", {})
    if not isinstance(env_table, dict):
        raise t.error("env", f"expected a table of strings, got {describe(env_table)}")
    for key, value in env_table.items():
        if not key or "=" in key or "\0" in key:
            raise t.error("env", f"invalid variable name {short_repr(key)}: it must be non-empty, without '=' or NUL")
        if not isinstance(value, str):
            raise t.error(f"env.{key}", f"expected a string, got {describe(value)}")
        if "\0" in value:
            raise t.error(f"env.{key}", "contains a NUL byte")
    credentials = _credentials(t, env_table)
    inherit = t.boolean("inherit_environment", True)
    cwd = t.string("working_directory", None)
    if cwd is not None and (not cwd.startswith("/") or "\0" in cwd):
        raise t.error("working_directory", f"expected an absolute path, got {short_repr(cwd)}")
    user = _account_name(t, "user")
    group = _account_name(t, "group")
    if group is not None and user is None:
        raise t.error("group", "is set without child.user: the child would keep root's user with another group")
    try:
        # What vLLM will see: its --config file's flags in place (config/vllm_yaml.py).
        seen, yaml_file = expand(argv, cwd)
        vllm = parse_vllm_args(seen)
    except ValueError as exc:
        raise t.error("argv", str(exc)) from None
    if yaml_file is not None:
        vllm = dataclasses.replace(vllm, config_file=str(yaml_file))
    t.done()
    return ChildConfig(tuple(argv), dict(env_table), inherit, cwd, user, group, credentials=credentials, vllm=vllm)


def _credentials(t: Table, env: dict[str, object]) -> dict[str, str]:
    """child.credentials = { VLLM_API_KEY = "kimi-api-key" }: each variable's value comes from the systemd
    credential of that name (LoadCredential=, which install-unit writes); docs/configuration.md."""
    table = t.raw("credentials", {})
    if not isinstance(table, dict):
        raise t.error("credentials", f"expected a table of credential names, got {describe(table)}")
    for key, name in table.items():
        if not key or "=" in key or "\0" in key:
            raise t.error(
                "credentials", f"invalid variable name {short_repr(key)}: it must be non-empty, without '=' or NUL"
            )
        if key in env:
            raise t.error(f"credentials.{key}", f"{key} is in child.env too: give its value in one place")
        # systemd's rule for a credential's name: a file name (no '/', not '.' or '..'), at most 255 bytes.
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.@:+-]{1,255}", name) or name in (".", ".."):
            raise t.error(
                f"credentials.{key}", f"expected a credential name (letters, digits, _.@:+-), got {short_repr(name)}"
            )
    return dict(table)


def _account_name(t: Table, name: str) -> str | None:
    """A user or group name (or numeric id); whether it exists is checked on the host, before the preflight."""
    value = t.string(name, None)
    if value is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.@-]{0,255}\$?", value):
        raise t.error(name, f"expected a {name} name or numeric id, got {short_repr(value)}")
    return value


def _parse_gpus(t: Table) -> tuple[int, ...] | None:
    value = t.raw("gpus", "all")
    if value == "all":
        return None
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1024 for x in value):
        if len(set(value)) != len(value):
            raise t.error("gpus", f"expected distinct GPU indices, got {value}")
        return tuple(value)
    raise t.error("gpus", f'expected "all" or an array of GPU indices (e.g. [0, 1]), got {describe(value)}')


def _reap_users(r: Table, child_user: str | None) -> tuple[str, ...]:
    default = ["root"] + ([child_user] if child_user and child_user != "root" else [])
    users = r.strings("users", default)
    if not users:
        raise r.error("users", "expected at least one user name (an empty list would mean nobody, not everyone)")
    for name in users:
        if not name.strip():
            raise r.error("users", f"expected user names, got {name!r}")
    return users


def _parse_preflight(t: Table, child_user: str | None = None) -> PreflightConfig:
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


# http+unix://%2Frun%2F...%2Fengine.sock/health: vLLM on its --uds socket (config/vllm_args.py).
_URL = r"^(https?|http\+unix)://[^/\s]+(/\S*)?$"


def _parse_readiness(t: Table, vllm: VllmArgs) -> ReadinessConfig:
    url = t.string("health_url", "") or vllm.health_url
    if not re.match(_URL, url):
        raise t.error("health_url", f"expected an http://, https:// or http+unix:// URL, got {url!r}")
    cfg = ReadinessConfig(
        started_patterns=t.patterns("started_patterns", DEFAULT_STARTED_PATTERNS),
        fatal_patterns=_fatal_rules(t),
        health_url=url,
        deadline_s=t.number("deadline_s", 1800.0, maximum=7 * 86400),
        stall_timeout_s=t.number("stall_timeout_s", 300.0, maximum=86400),
        poll_interval_s=t.number("poll_interval_s", 0.25, maximum=60),
    )
    if not cfg.started_patterns:
        raise t.error("started_patterns", "expected at least one pattern, got an empty array")
    t.done()
    return cfg


def _parse_health(t: Table) -> HealthConfig:
    cfg = HealthConfig(
        interval_s=t.number("interval_s", 5.0, maximum=3600),
        timeout_s=t.number("timeout_s", 3.0, maximum=600),
        failures_tolerated=t.integer("failures_tolerated", 3, minimum=1, maximum=1000),
    )
    t.done()
    return cfg


def _parse_shutdown(t: Table) -> ShutdownConfig:
    cfg = ShutdownConfig(
        grace_s=t.number("grace_s", 30.0, maximum=3600),
        second_signal_grace_s=t.number("second_signal_grace_s", 2.0, maximum=3600, zero_ok=True),
        gpu_release_timeout_s=t.number("gpu_release_timeout_s", 30.0, maximum=3600, zero_ok=True),
    )
    t.done()
    return cfg


def _parse_paths(t: Table, config: Path) -> PathsConfig:
    def absolute(name: str, default: str) -> Path:
        value = t.string(name, default) or default
        # Relative: to the config file's directory (the demo keeps its files under the checkout, not /tmp).
        return Path(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(config)), value)))

    cache = t.string("cache_directory", "/var/cache/kimi-supervisor")
    cfg = PathsConfig(
        runtime_directory=absolute("runtime_directory", "/run/kimi-supervisor"),
        state_directory=absolute("state_directory", "/var/lib/kimi-supervisor"),
        cache_directory=absolute("cache_directory", cache) if cache else None,  # "": leave the caches to vLLM
    )
    t.done()
    return cfg


def _parse_readahead(t: Table) -> ReadaheadConfig:
    cfg = ReadaheadConfig(
        enabled=t.boolean("enabled", False), shards_ahead=t.integer("shards_ahead", 2, minimum=1, maximum=64)
    )
    t.done()
    return cfg


def _parse_metrics(t: Table) -> MetricsConfig:
    value = t.string("textfile", None)
    if value is not None and not (value.startswith("/") and value.endswith(".prom")):
        raise t.error(
            "textfile", f"expected an absolute path ending in .prom (node_exporter reads only *.prom), got {value!r}"
        )
    t.done()
    return MetricsConfig(Path(value) if value else None)


def _parse_liveness(t: Table, vllm: VllmArgs) -> LivenessConfig:
    when = t.string("when", "idle")
    if when not in ("idle", "always"):
        raise t.error("when", f'expected "idle" or "always", got {when!r}')
    metrics_url = t.string("metrics_url", "") or vllm.api_url("/metrics")
    if not re.match(_URL, metrics_url):
        raise t.error("metrics_url", f"expected an http://, https:// or http+unix:// URL, got {metrics_url!r}")
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


def _parse_gpu_health(t: Table) -> GpuHealthConfig:
    def policy(name: str, default: str) -> str:
        value = t.string(name, default)
        if value not in GPU_HEALTH_POLICIES:
            raise t.error(name, f'expected "fail", "warn" or "off", got {value!r}')
        return value

    ignored = t.raw("xid_ignored", [63, 92])
    if not isinstance(ignored, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ignored):
        raise t.error("xid_ignored", f"expected an array of XID numbers, got {describe(ignored)}")
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


# A deployment's name goes into file names, unit instance names and a metrics label: no path separators,
# nothing a shell or systemd's specifier syntax would read, bounded.
_DEPLOYMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _parse_deployment(t: Table, path: Path) -> DeploymentConfig:
    role = t.string("role", Role.ENGINE.value)
    if role not in ROLE_NAMES:
        raise t.error("role", f"expected one of {', '.join(repr(r) for r in ROLE_NAMES)}, got {short_repr(role)}")
    # NAME.front.toml and NAME.weights.toml are deployment NAME's (roles.py config_name), as their units run them:
    # their role's suffix is no part of the name.
    stem = path.name.removesuffix(".toml").removesuffix(Role(role).file_suffix)
    name = t.string("name", None)
    if name is None:
        if not _DEPLOYMENT_NAME.match(stem):
            raise t.error(
                "name",
                f"the config file's name {stem!r} cannot name the deployment (letters, digits, '_', '.', '-'; "
                "at most 64): set deployment.name",
            )
        name = stem
    elif not _DEPLOYMENT_NAME.match(name):
        raise t.error(
            "name",
            f"expected letters, digits, '_', '.' or '-' (at most 64, not starting with a sign), got {short_repr(name)}",
        )
    t.done()
    return DeploymentConfig(name=name, role=Role(role))


def _own_devices(child: ChildConfig, preflight: PreflightConfig, role: Role, path: Path) -> ChildConfig:
    """The child's GPUs pinned to preflight.gpus and its own NCCL RAS endpoint (config/gpu_pinning.py)."""
    try:
        env = pinned_env(child.env, preflight.gpus)
        env = ras_env(env, preflight.gpus, slot=role_spec.of(role).ras_slot)
    except PinningError as exc:
        raise ConfigError(f"{path}: child.env.{exc.key}: {exc}") from None
    return dataclasses.replace(child, env=env)


def _check_world_size(child: ChildConfig, preflight: PreflightConfig, path: Path) -> None:
    """One node's vLLM takes TP x PP x DP GPUs (a group node's share is checked by config/cluster.py)."""
    vllm = child.vllm
    if preflight.gpus and len(preflight.gpus) < vllm.world_size:
        raise ConfigError(
            f"{path}: preflight.gpus: {len(preflight.gpus)} GPU(s) {list(preflight.gpus)}, but child.argv's "
            f"{vllm.parallel_flags} needs {vllm.world_size}"
        )


def _parse_weights(
    t: Table, present: bool, deployment: DeploymentConfig, child: ChildConfig, paths: PathsConfig, path: Path
) -> tuple[WeightsConfig | None, ChildConfig]:
    """The holder's argv completed (socket dir, /health), or the engine's checked against the holder's: as the
    role reads [weights] (config/role_spec.py, config/weights_table.py)."""
    sockets = socket_dir(paths.runtime_directory, deployment.name)
    read = role_spec.of(deployment.role).read_weights
    try:
        return read(t, present, deployment.role, child, sockets)
    except WeightsArgError as exc:
        raise ConfigError(f"{path}: {exc.key}: {exc}") from None


def _role_defaults(
    data: Mapping[str, Any], role: Role, readiness: ReadinessConfig, liveness: LivenessConfig
) -> tuple[ReadinessConfig, LivenessConfig]:
    """The role's own defaults (config/role_spec.py) for the keys the file leaves out."""
    spec = role_spec.of(role)
    given_r, given_l = data.get("readiness", {}), data.get("liveness", {})
    readiness = dataclasses.replace(
        readiness, **{k: value(readiness) for k, value in spec.readiness_defaults.items() if k not in given_r}
    )
    liveness = dataclasses.replace(liveness, **{k: v for k, v in spec.liveness_defaults.items() if k not in given_l})
    return readiness, liveness


# The child of a role without one (config/role_spec.py has_child): a front (docs/front.md), whose run never reads
# it.  Kept, not `Config.child: ChildConfig | None`, because code that runs for every config before or without
# asking the role reads cfg.child: cli/entry.py (the secret values it scrubs from every event, the child.argv
# secret warning, check-config's effective config, the dry run's environment report, the supervisor.start
# event's argv) and this parse's own steps after this one (_parse_weights, _parse_preflight's reap users,
# _own_devices, the readiness and liveness URLs from child.vllm, parse_cluster): a None there would be a check in
# each.  Every such reader meets an empty argv, environment and credentials, so a front's config says nothing.
NO_CHILD = ChildConfig((), {}, False, None, None, vllm=parse_vllm_args(["none"]))


def _no_child(root: Table, role: Role) -> ChildConfig:
    if root.has("child"):
        raise root.error("child", f"deployment.role = {role.value!r} runs no child (docs/front.md): remove [child]")
    return NO_CHILD


def _refuse_tables(root: Table, data: Mapping[str, Any], role: Role) -> None:
    """A table its role's config does not have (config/role_spec.py tables), e.g. a front's [readiness]: refused
    rather than read and ignored."""
    allowed = role_spec.of(role).tables
    for name in data:
        if name in role_spec.TABLES and name not in allowed:
            have = ", ".join(f"[{t}]" for t in sorted(allowed))
            raise root.error(
                name, f"deployment.role = {role.value!r} does not read [{name}] (its config has {have}): remove it"
            )


def _parse_front(
    root: Table, reads: bool, deployment: DeploymentConfig, paths: PathsConfig, path: Path
) -> FrontConfig | None:
    """[front] exactly for a front (config/role_spec.py reads_front)."""
    if not reads:
        if root.has("front"):
            raise root.error(
                "front", f'[front] is for a front\'s config (deployment.role = "front"), not {deployment.role.value!r}'
            )
        return None
    return parse_front(root.table("front"), paths.runtime_directory, paths.state_directory, deployment.name, path)


def _spare_child(root: Table, deployment: DeploymentConfig, path: Path) -> tuple[SpareConfig, ChildConfig, Config]:
    """A hot spare's child: its engine's (NAME.toml beside it), with its own socket and memory flags
    (config/spare.py); its [child] refused, where a second argv could drift from the engine's."""
    if root.has("child"):
        raise root.error(
            "child",
            f"deployment.role = {deployment.role.value!r} runs its engine's child "
            f"({spare.engine_config_path(path, deployment.name)}) with its own socket and memory flags ([spare]): "
            "remove [child]",
        )
    engine_path = spare.engine_config_path(path, deployment.name)
    if not engine_path.exists():
        raise ConfigError(
            f"{path}: deployment.name: {deployment.name!r}: a spare runs its engine's argv, and its engine's config "
            f"{engine_path} is not there"
        )
    engine = load_config(engine_path)
    if engine.deployment.name != deployment.name:
        raise ConfigError(
            f"{engine_path}: deployment.name: {engine.deployment.name!r}: the spare {path} is of deployment "
            f"{deployment.name!r}"
        )
    spare.check_engine(engine, engine_path, role_spec.of(engine.role).takes_spare)
    spare_cfg = spare.parse_spare(root.table("spare"), engine_path)
    socket = spare.socket_path(engine.paths.runtime_directory, deployment.name)
    spare_cfg = dataclasses.replace(
        spare_cfg,
        output_key=spare.output_key(engine.child.argv, dict(engine.child.env)),
        engine_gpu_memory_utilization=engine.child.vllm.gpu_memory_utilization,
        engine_kv_cache_memory_bytes=spare.engine_kv_bytes(engine.child.argv, engine_path),
    )
    return spare_cfg, spare.derive_child(engine, socket, spare_cfg), engine


def parse_config(data: Mapping[str, Any], path: Path) -> Config:
    """Build a Config from parsed TOML; raises ConfigError naming file and key."""
    root = Table(data, "", path)
    if not data:
        raise ConfigError(f"{path}: the file is empty; required key 'child.argv' is missing")
    deployment = _parse_deployment(root.table("deployment"), path)
    spec = role_spec.of(deployment.role)
    spare_cfg, engine = None, None
    if spec.child_of_engine:
        spare_cfg, child, engine = _spare_child(root, deployment, path)
    elif spec.has_child:
        child = _parse_child(root.table("child"))
    else:
        child = _no_child(root, deployment.role)
    if child.vllm.config_file is not None and ("cluster" in data or "weights" in data):
        # Their rank and weight-cache flags are checked, and written, in child.argv's own words.
        raise ConfigError(
            f"{path}: child.argv: --config {child.vllm.config_file}: a multi-node or weight-holder deployment "
            "keeps every vLLM flag in child.argv, where the supervisor checks its rank and weight-cache flags"
        )
    paths = _parse_paths(root.table("paths"), path)
    if engine is not None and "paths" not in data:
        paths = engine.paths  # a spare's directories are its engine's (the holder's sockets, the front's)
    front = _parse_front(root, spec.reads_front, deployment, paths, path)
    _refuse_tables(root, data, deployment.role)
    # Before readiness and liveness: a holder's /health is on the port its argv gets here.
    weights, child = _parse_weights(root.table("weights"), "weights" in data, deployment, child, paths, path)
    given_gpus = isinstance(data.get("preflight"), dict) and "gpus" in data["preflight"]
    preflight = _parse_preflight(root.table("preflight"), child.user)
    if not spec.has_child:
        preflight = dataclasses.replace(preflight, gpus=())  # no child: nothing of it runs on a GPU
    if engine is not None:  # a spare: on its engine's GPUs, in its engine's directories
        spare.check_beside(path, engine, paths, given_gpus, preflight)
        preflight = dataclasses.replace(preflight, gpus=engine.preflight.gpus)
    child = _own_devices(child, preflight, deployment.role, path)
    readiness = _parse_readiness(root.table("readiness"), child.vllm)
    health = _parse_health(root.table("health"))
    shutdown = _parse_shutdown(root.table("shutdown"))
    metrics = _parse_metrics(root.table("metrics"))
    liveness = _parse_liveness(root.table("liveness"), child.vllm)
    gpu_health = _parse_gpu_health(root.table("gpu_health"))
    readiness, liveness = _role_defaults(data, deployment.role, readiness, liveness)
    cluster = parse_cluster(root.table("cluster"), "cluster" in data, deployment.role, child)
    readahead = _parse_readahead(root.table("readahead"))
    if cluster is not None:
        node = apply_cluster(GroupNode(cluster, child, readiness, liveness, shutdown), data, preflight, path)
        cluster, child, readiness = node.cluster, node.child, node.readiness
        liveness, shutdown = node.liveness, node.shutdown
    else:
        _check_world_size(child, preflight, path)
    root.done()
    child = dataclasses.replace(child, cache_directory=paths.cache_directory)
    return Config(
        path,
        child,
        preflight,
        readiness,
        health,
        shutdown,
        paths,
        metrics,
        liveness,
        gpu_health,
        deployment,
        cluster,
        readahead,
        weights,
        front,
        spare_cfg,
    )


def load_config(path: Path) -> Config:
    """Read (config/file.py: regular file, size cap, StrictModes as root) and validate the TOML file."""
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
        if isinstance(value, FatalRule):
            return value.text  # as written in the file: `file.py: message`
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
        if isinstance(value, enum.Enum):
            return value.value
        return value

    result = plain(cfg)
    assert isinstance(result, dict)
    return result
