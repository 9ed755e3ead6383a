"""Command line: parse, build the parts, run; every SupervisorError is caught here, once."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Sequence

from kimi_supervisor import __version__
from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.child.cachedirs import CacheUntrusted
from kimi_supervisor.child.process import prepare_spawn
from kimi_supervisor.child.spawnplan import Unresolvable, credential_values
from kimi_supervisor.cli.args import parse_args
from kimi_supervisor.clock import SystemClock
from kimi_supervisor.config import layout, timeouts
from kimi_supervisor.config.load import effective_config, load_config
from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment, RunContext
from kimi_supervisor.deployment.choose import for_config
from kimi_supervisor.exitcodes import ConfigError, DeploymentUnknown, ExitCode, SupervisorError, exit_outcome
from kimi_supervisor.files import dirtrust
from kimi_supervisor.host import instance_lock
from kimi_supervisor.host.gpu import GpuProbe, GpuUnavailable, configured_gpus, pin_configured_gpus
from kimi_supervisor.host.nvml import NvmlProbe
from kimi_supervisor.host.proctable import PsutilProcessTable
from kimi_supervisor.logs.journal import ChildSink, close_outputs, configure, get_logger, resolve_format
from kimi_supervisor.preflight.report import render_json, render_text
from kimi_supervisor.preflight.run import Preflight, PreflightReport
from kimi_supervisor.redact import redact_argv, redact_env, redact_text, secrets_in_argv, secrets_of
from kimi_supervisor.roles import Role
from kimi_supervisor.systemd import show, unit
from kimi_supervisor.systemd.notify import RedactingNotifier, notifier_from_env, watchdog_interval


def _load(args: argparse.Namespace) -> Config:
    # Ownership, mode, file type and size are checked on the open file (config/file.py).
    cfg = load_config(args.config)
    grace = timeouts.check_grace(cfg)
    if grace.blocking and not args.dry_run:  # the dry run shows it as a FAILED check instead
        err = ConfigError(grace.message)
        if args.command == "run":
            _record_refused_start(cfg, err, NvmlProbe())
        raise err
    return cfg


def _record_refused_start(cfg: Config, err: SupervisorError, probe: GpuProbe) -> None:
    """A start refused before its run: failed in the state file, history and textfile where that clobbers
    no running supervisor's (cli/prerun.py)."""
    from kimi_supervisor.cli.prerun import record_failed_start  # only a refused start pays for the view

    reason = redact_text(err.message, secret_values(cfg))
    own = for_config(cfg).lock_resources(())  # its own files' locks alone are asked (instance_lock.own_files)
    record_failed_start(cfg, int(err.exit_code), reason, probe, get_logger(), own)


def _unit_stop_check(cfg: Config) -> Check | None:
    if not show.systemd_running():
        return None
    name = layout.unit_name(cfg.deployment.name, cfg.role) + ".service"  # the plain unit's, or this instance's
    return timeouts.check_unit_stop(cfg, show.installed_stop_timeout_s(name), name)


def _install_unit(cfg: Config, args: argparse.Namespace) -> int:
    config = args.config.resolve()
    role = for_config(cfg)
    own = role.install_own_unit(config, args.unit_dir, reload=not args.no_reload, instance=args.instance)
    if own is not None:  # a front's template (docs/front.md): a unit of its own, not the engine's pair
        print(f"wrote {own}; now: systemctl enable --now {layout.unit_name(cfg.deployment.name, cfg.role)}.service")
        return ExitCode.OK
    instance = args.instance
    if instance is not None:
        # One name for the instance, its config file, its files, its journal identifier and metrics label.
        if config.stem != instance:
            raise ConfigError(
                f"install-unit --instance {instance}: kimi-supervisor@{instance} runs "
                f"{config.parent}/{instance}.toml, not {config} (name the config after the instance)"
            )
        if cfg.deployment.name != instance:
            raise ConfigError(
                f"{config}: deployment.name: {cfg.deployment.name!r} is not the instance's name {instance!r} "
                "(the unit's directories are named after the instance: remove deployment.name or make it match)"
            )
    holder = role.holder_unit(config, instance)
    front = role.front_config(config)  # checked before anything is written
    if front is not None and instance is None:
        # The front's template runs <dir>/NAME.front.toml beside the engine's template's NAME.toml.
        raise ConfigError(
            f"{front}: a deployment with a front needs the unit pair: install-unit --instance {cfg.deployment.name}"
        )
    written = unit.install(
        config,
        args.unit_dir,
        reload=not args.no_reload,
        stop_s=timeouts.unit_timeout_stop_s(cfg),
        instance=instance,
        writable=unit.writable_paths(cfg),
        holder=holder,
        credentials=sorted(set(cfg.child.credentials.values())),
        serves=unit.serving(cfg),
        front=front is not None,
    )
    services = [unit.UNIT_NAME if instance is None else f"kimi-supervisor@{instance}.service"]
    if holder is not None:
        services.insert(0, layout.holder_service(cfg.deployment.name))
    if front is not None:
        services.append(layout.unit_name(cfg.deployment.name, Role.FRONT) + ".service")
    listed = ", ".join(str(p) for p in written[:-1]) + " and " if len(written) > 1 else ""
    print(f"wrote {listed}{written[-1]}; now: systemctl enable --now {' '.join(services)}")
    return ExitCode.OK


def _check_config(cfg: Config, as_json: bool) -> int:
    data = effective_config(cfg)
    data["child"]["argv"] = redact_argv(cfg.child.argv)
    data["child"]["env"] = redact_env(cfg.child.env)
    stop = _unit_stop_check(cfg)
    if stop is not None and stop.verdict is Verdict.WARN:
        print(f"kimi-supervisor: warning: {stop.message}", file=sys.stderr)
    in_argv = argv_secret_warning(cfg)
    if in_argv is not None:
        print(f"kimi-supervisor: warning: {in_argv}", file=sys.stderr)
    if as_json:
        text = json.dumps(data, indent=2)
    else:
        text = f"# {cfg.path}: valid\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in _flatten(data))
    # A secret value may also sit where no rule names it (a model path, a URL): remove it everywhere.
    print(redact_text(text, secret_values(cfg)))
    return ExitCode.OK


def _flatten(data: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(data, dict):
        out: list[tuple[str, object]] = []
        for k, v in data.items():
            if k == "path" and not prefix:
                continue
            out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "env" else [(f"{prefix}{k}", v)]
        return out
    return [(prefix.rstrip("."), data)]


def _dry_run(cfg: Config, as_json: bool) -> int:
    log = get_logger()
    role = for_config(cfg)
    probe = NvmlProbe()
    try:
        # Never takes the lock (a real start beside us must not refuse because of a dry run): only reads it.
        owner = instance_lock.find_owner(role.lock_resources(configured_gpus(probe, cfg.preflight.gpus)))
        # A role without a child (a front) has no preflight: nothing of its own on the GPUs, shm or a model.
        table, clock = PsutilProcessTable(), SystemClock()
        report = (
            Preflight(cfg, probe, table, clock, log).run(dry_run=True)
            if role.has_child
            else PreflightReport(dry_run=True)
        )
        gpu_count = _gpu_count(cfg, probe)
        child = pin_configured_gpus(cfg.child, cfg.preflight.gpus, probe)
    finally:
        probe.close()
    stop = _unit_stop_check(cfg)
    if stop is not None:
        report.checks.append(stop)
    role.dry_run(report.checks, gpu_count)  # a group's checks, a weight holder's, or an engine's view of it
    try:
        if role.has_child:  # a front has none (docs/front.md)
            prepare_spawn(cfg.child, os.environ, create=False)  # a dry run makes and chowns nothing
    except Unresolvable as exc:
        # A real start stops here (exit 78) before the preflight acts; the report says so first.
        report.checks.insert(0, Check("child", Verdict.FAIL, f"child.{exc.key}: {exc.message}"))
    except CacheUntrusted as exc:  # so does a cache home another account could write (cachedirs.py)
        report.checks.insert(0, Check("cache", Verdict.FAIL, exc.message))
    try:
        dirtrust.prepare_directories(cfg, create=False)
    except ConfigError as exc:  # a real start exits 78 here, before the preflight acts
        report.checks.insert(0, Check("paths", Verdict.FAIL, exc.message))
    if owner is not None:
        report.checks.insert(0, Check("instance", Verdict.FAIL, instance_lock.dry_run_text(owner), {"pid": owner.pid}))
    in_argv = argv_secret_warning(cfg)
    if in_argv is not None:
        report.checks.append(Check("secrets", Verdict.WARN, in_argv))
    # A credential's value is read only by a real start: the report names where it would come from.
    env = redact_env(child.env) | {k: f"<credential {name}>" for k, name in cfg.child.credentials.items()}
    print(render_json(report, str(cfg.path), env) if as_json else render_text(report, str(cfg.path)))
    if owner is not None:
        return ExitCode.ANOTHER_INSTANCE
    return ExitCode.OK if report.proceed else ExitCode.PREFLIGHT_FAILED


def _gpu_count(cfg: Config, probe: GpuProbe) -> int:
    if cfg.preflight.gpus == ():
        return 0
    try:
        return probe.device_count()
    except GpuUnavailable:
        return 0


def _run(cfg: Config, sink: ChildSink, probe: GpuProbe) -> int:
    role = for_config(cfg)
    try:
        try:
            # Root's files go only where no other account can steer the writes (exit 78 naming the key).
            dirtrust.prepare_directories(cfg)
            # Before any preflight action: a second supervisor must change nothing (exit 16).  Without NVML no
            # GPU is locked: the preflight fails on NVML before touching anything, and the port lock still holds.
            lock = instance_lock.acquire(role.lock_resources(configured_gpus(probe, cfg.preflight.gpus)), str(cfg.path))
        except SupervisorError as err:  # refused before the run: still failed, where the operator looks
            _record_refused_start(cfg, err, probe)
            raise
        try:
            return _supervise(role, sink, probe)
        finally:
            lock.close()
    finally:
        probe.close()


def _supervise(role: Deployment, sink: ChildSink, probe: GpuProbe) -> int:
    """What every run has (RunContext); the role's run builds the rest (a supervised child's: the lifecycle's
    Deps, deployment/supervised.py)."""
    cfg = role.cfg
    log = get_logger()
    secrets = secret_values(cfg)
    ctx = RunContext(
        log=log,
        notifier=RedactingNotifier(notifier_from_env(log=log), secrets),
        watchdog_s=watchdog_interval(),
        secrets=secrets,
        probe=probe,
        sink=sink,
    )
    log.info(
        "supervisor.start",
        version=__version__,
        config=str(cfg.path),
        pid=os.getpid(),
        argv=" ".join(redact_argv(cfg.child.argv)),
        watchdog_s=ctx.watchdog_s,
    )
    stop = _unit_stop_check(cfg)
    if stop is not None and stop.verdict is Verdict.WARN:
        log.warning("unit.timeout_stop_short", why=stop.message, **stop.data)
    in_argv = argv_secret_warning(cfg)
    if in_argv is not None:
        log.warning("config.secret_in_argv", why=in_argv)
    return role.run(ctx)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fmt = resolve_format(args.log_format)
    secrets = secrets_of((), os.environ)  # the inherited ones are known before the config is
    sink = configure(fmt, args.log_level, secrets=secrets)
    log = get_logger()
    try:
        if args.command == "status":
            # only what reading files (and the process table) needs
            from kimi_supervisor.cli.status import DEFAULT_RUNTIME_DIR, run_status, running_configs

            if args.name is not None and args.config is not None:
                raise ConfigError(f"status: give NAME ({args.name}) or --config ({args.config}), not both")
            try:
                return run_status(
                    args.config,
                    args.json,
                    args.watch,
                    name=args.name,
                    runtime_dirs=(DEFAULT_RUNTIME_DIR,),
                    running=running_configs,
                )
            except DeploymentUnknown as err:  # a script's question, answered in one line as a config error is
                print(f"kimi-supervisor: {err.message}", file=sys.stderr)
                return int(exit_outcome(err)[0])
        cfg = _load(args)
        # Known secret values (HF_TOKEN=...) are scrubbed from every event from now on.
        secrets = secret_values(cfg)
        identity = {
            "SYSLOG_IDENTIFIER": layout.unit_name(cfg.deployment.name, cfg.role),
            "KIMI_DEPLOYMENT": cfg.deployment.name,
        }
        sink = configure(fmt, args.log_level, secrets=secrets, identity=identity)
        if args.command == "check-config":
            return _check_config(cfg, args.json)
        if args.command == "install-unit":
            return _install_unit(cfg, args)
        if args.dry_run:
            return _dry_run(cfg, args.json)
        probe = NvmlProbe()
        return _run(cfg, sink, probe)
    # Each code is exit_outcome's (exitcodes.py): one table for the exit status and the run's record.
    except ConfigError as err:
        # Exactly one line an operator can act on; the unit does not restart on 78.
        print(f"kimi-supervisor: config error: {redact_text(err.message, secrets)}", file=sys.stderr)
        code = int(exit_outcome(err)[0])
        if fmt == "journal":
            log.error("supervisor.exit", error=err.message, exit_code=code, kind="ConfigError")
        return code
    except SupervisorError as err:
        code = int(exit_outcome(err)[0])
        log.error("supervisor.exit", error=err.message, exit_code=code, kind=type(err).__name__)
        for line in err.detail:
            log.error("supervisor.detail", line=line)
        return code
    except GpuUnavailable as err:  # NVML lost a GPU (or its driver) outside the preflight's checks
        code = int(exit_outcome(err)[0])
        log.error("supervisor.exit", error=str(err), exit_code=code, kind="GpuUnavailable")
        return code
    except BrokenPipeError as err:  # `kimi-supervisor --dry-run | head`: the reader left (a run stopped its tree first)
        # Python's docs' recipe: point stdout at /dev/null so the flush at exit does not raise again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(exit_outcome(err)[0])
    except KeyboardInterrupt as err:  # Ctrl-C in a --dry-run or check-config (a run handles SIGINT itself)
        return int(exit_outcome(err)[0])
    except Exception as err:  # a bug: keep the traceback, exit with a code that says so (the tree is stopped already)
        log.critical("supervisor.crash", traceback=traceback.format_exc())
        return int(exit_outcome(err)[0])
    finally:
        close_outputs()


def secret_values(cfg: Config) -> tuple[str, ...]:
    # The inherited environment too: a HF_TOKEN in the supervisor's own environment reaches the child; and
    # child.credentials' values, which only the child's environment holds.
    known = credential_values(cfg.child.credentials, os.environ)
    return secrets_of(cfg.child.argv, cfg.child.env, os.environ, known=known)


def argv_secret_warning(cfg: Config) -> str | None:
    """A secret in child.argv (`--api-key VALUE`): every local user reads it in /proc/PID/cmdline."""
    found = secrets_in_argv(cfg.child.argv)
    if not found:
        return None
    return (
        f"child.argv holds a secret ({', '.join(found)}): any local user can read it in /proc/PID/cmdline; "
        "move it to child.credentials (a systemd credential passed in the child's environment, "
        "e.g. VLLM_API_KEY for --api-key; docs/configuration.md)"
    )
