"""The systemd units: one text, rendered as the plain unit and as the template unit, for packaging/ and by
`install-unit`.

packaging/systemd/kimi-supervisor.service (one deployment per host, /etc/kimi-supervisor/kimi-supervisor.toml)
and packaging/systemd/kimi-supervisor@.service (instance NAME runs /etc/kimi-supervisor/NAME.toml, as
`openvpn@`, `wg-quick@` and `postgresql@` do) are this text rendered with the defaults (a test keeps them
identical); `kimi-supervisor install-unit [--instance NAME]` renders it with the command that runs this very
installation and reloads systemd.  An instance's own settings from its config (TimeoutStopSec=, the
directories it writes) go in a drop-in of that instance, `kimi-supervisor@NAME.service.d/`, so one template
serves every deployment.

A deployment with a weight holder (docs/weight-holder.md) is a pair of units: the holder's template
`kimi-supervisor-weights@.service` (instance NAME runs NAME.weights.toml, `vllm preload`) and the engine's
`kimi-supervisor@NAME.service`, whose drop-in binds it to the holder (`BindsTo=` + `After=`: started once the
holder is ready, stopped first whenever the holder stops; its own restarts never touch the holder), while the
holder `Wants=` its engine, so each (re)start of the holder, a reload, starts the engine again after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import pwd
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.config import role_spec, timeouts
from kimi_supervisor.config.load import DEFAULT_PATH
from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import ConfigError, ExitCode, NoPermission, ServiceUnavailable
from kimi_supervisor.roles import Role

UNIT_NAME = "kimi-supervisor.service"
TEMPLATE_NAME = "kimi-supervisor@.service"
HOLDER_TEMPLATE_NAME = "kimi-supervisor-weights@.service"  # a deployment's weight holder (docs/weight-holder.md)
TEMPLATE_RESTART_SEC = 15  # after a crash that reloads 540 GB: the GPUs freed, nothing hurried
HOLDER_ENGINE_RESTART_SEC = 2  # an engine beside its weight holder (instance_dropin)
DROPIN_NAME = "50-kimi-supervisor.conf"  # install-unit --instance NAME: that instance's own settings
# The README's install: a virtualenv of its own (Debian 12 and Ubuntu 24.04 refuse `pip install` into the
# system's python, PEP 668), whose console script and data files (share/doc, share/man) live under it.
DEFAULT_PREFIX = Path("/opt/kimi-supervisor")
DEFAULT_EXEC = str(DEFAULT_PREFIX / "bin" / "kimi-supervisor")
DOC_DIR = Path("share/doc/kimi-supervisor")  # pyproject's data-files: README.md and docs/
DEFAULT_DOC = DEFAULT_PREFIX / DOC_DIR / "README.md"
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
STATE_DIR = Path("/var/lib/kimi-supervisor")  # the unit's StateDirectory=
# What `install-unit` derives from etc/kimi-supervisor.toml (timeouts.unit_timeout_stop_s; a test keeps them
# equal): grace 315 (vLLM drains 300 s + 15 s worker shutdown) + SIGKILL wait 5 + GPU release 30 + exit 10.
DEFAULT_STOP_S = 360

TEXT = """\
# kimi-supervisor: vLLM as a Type=notify service.
{header}# Rendered by `kimi-supervisor install-unit{install_args}`; edit the config, not this file.
[Unit]
Description=vLLM{serves}{what} supervised by kimi-supervisor{description}
{documentation}# The driver's persistence daemon keeps GPUs initialised; the API needs the network.
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
# Five failed starts within an hour stop the restart loop (a 9-minute load each).
StartLimitIntervalSec=3600
StartLimitBurst=5
{unit_extra}
[Service]
Type=notify
# Only the supervisor speaks sd_notify; vLLM's processes must not.
NotifyAccess=main
ExecStart={command}
# First window only: the supervisor extends it (EXTEND_TIMEOUT_USEC) while vLLM makes progress.
TimeoutStartSec=180
# Derived from the config by install-unit: shutdown.grace_s (covers vLLM's --shutdown-timeout drain and
# its worker shutdown) + SIGKILL wait (5) + shutdown.gpu_release_timeout_s + 10 s for the supervisor's exit.
# Shorter, and systemd SIGKILLs the cgroup while vLLM still drains (check-config and --dry-run warn).
TimeoutStopSec={stop_s}
# Pinged only while GET /health passes; a hung server is killed and restarted.
WatchdogSec=60
# SIGTERM to the supervisor alone (it stops its tree in order), then SIGKILL to whatever is left.
KillMode=mixed
Restart=on-failure
RestartSec={restart_sec}
# Restarting cannot fix these: 78 = configuration error; 22 = a process on our GPUs survives SIGKILL (stuck in
# the NVIDIA driver), its GPUs never free until a GPU reset or a reboot.
RestartPreventExitStatus={config_exit} {reset_exit}
# vLLM pins host memory for GPU transfers and opens many files (119 shards, sockets).
LimitMEMLOCK=infinity
LimitNOFILE=1048576
# Journal lines keep their priority (the supervisor sends native journal records, each with this identifier
# and KIMI_DEPLOYMENT=<deployment.name>).
SyslogIdentifier={syslog}
# journald rate-limits per unit and priority; a chatty vLLM used up the default (10000 per 30 s) and the
# supervisor's own records (state.*, stop.*) were dropped. The supervisor forwards at most 4000 child lines
# a second per priority (the rest are counted in "child.suppressed" records): at most 44000 in any 10 s
# window, so this burst always leaves room for its own records.
LogRateLimitIntervalSec=10s
LogRateLimitBurst=60000
{directories}
# Hardening that vLLM still runs under (docs/hardening.md gives each line's reason).
NoNewPrivileges=yes
# The whole tree read-only, but for the API filesystems (/dev/shm: the preflight's stale files), the
# directories above and homes: vLLM, torch, Triton and Hugging Face write their caches under $HOME.
ProtectSystem=strict
ReadWritePaths=-/root -/home
{writable}{credentials}PrivateTmp=yes
# Our mounts (the private /tmp, /proc, the read-only tree) never propagate to the host.
PrivateMounts=yes
# Other users' processes are hidden from vLLM running as child.user; root with CAP_SYS_PTRACE (the
# supervisor's preflight) still sees every process, as it must to find stale GPU processes.
ProtectProc=invisible
# Devices: the standard pseudo devices, and NVIDIA's by their /proc/devices names (nvidia or
# nvidia-frontend: /dev/nvidia[0-9]* and nvidiactl; nvidia-uvm, nvidia-caps, nvidia-nvlink, nvidia-nvswitch),
# whatever major numbers the driver got. The names resolve at each start: load nvidia-uvm at boot
# (modules-load.d), or a start before its first use has no /dev/nvidia-uvm access.
DevicePolicy=closed
DeviceAllow=char-nvidia* rw
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
LockPersonality=yes
SystemCallArchitectures=native
# NCCL and the API use IP sockets; NCCL and the supervisor use UNIX sockets; netlink lists interfaces.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
# KILL: reap stale workers of any user; SETUID/SETGID: child.user; SYS_PTRACE/DAC_READ_SEARCH: read
# other processes' /proc fds and maps; FOWNER: remove others' files in sticky /dev/shm; DAC_OVERRIDE: a
# root child reads model files and caches whatever their mode; LEASE: the write-lease probe answers for shm
# files of other users whose openers /proc does not show; CHOWN: child.user gets the directories made for it
# (its cache home, the holder's and the front's socket directories: files/privdir.py), without which its
# compile caches were lost at every start. No IPC_LOCK: LimitMEMLOCK=infinity already lets vLLM lock what it
# pins.
CapabilityBoundingSet=CAP_KILL CAP_SETUID CAP_SETGID CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_FOWNER \\
    CAP_DAC_OVERRIDE CAP_LEASE CAP_CHOWN
# Allow-list of the syscalls ordinary services use, minus groups vLLM never needs; a blocked call
# fails with EPERM instead of killing the server. (@resources stays: torch sets CPU affinity.)
SystemCallFilter=@system-service
SystemCallFilter=~@mount @reboot @swap @module @raw-io @obsolete @cpu-emulation @clock @debug
SystemCallErrorNumber=EPERM
# Caches and logs the server writes are its own user's (the supervisor's own files get their modes set).
UMask=0077
# Not set, because vLLM breaks: MemoryDenyWriteExecute (Triton/torch.compile JIT), PrivateDevices
# (/dev/nvidia* are not in a private /dev), ProtectHome (model venv and caches under /root), PrivateNetwork
# and IPAddressDeny (it serves clients), ProcSubset=pid (NVML, psutil and /proc/locks read /proc's files).

[Install]
WantedBy=multi-user.target
"""


PLAIN_DIRECTORIES = """\
# /run/kimi-supervisor: the instance locks (GPUs and ports are the host's), and below it this deployment's
# live state file (kimi-supervisor/state.json). Preserved across stops: removing it while another instance
# (started from a shell) holds its lock would let a third one in beside it.
RuntimeDirectory=kimi-supervisor
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
# /var/lib/kimi-supervisor/kimi-supervisor: the run history, kept across restarts and reboots.
StateDirectory=kimi-supervisor
StateDirectoryMode=0755
# /var/cache/kimi-supervisor: vLLM's torch.compile/AOT, Triton, inductor and CUDA JIT caches, kept across
# restarts whoever the child runs as (paths.cache_directory; each child uid gets <dir>/uid-<uid>): without it a
# child without a home recompiles on every start (minutes at TP=8). Shared by the host's deployments: vLLM's
# cache key hashes the model and its whole config, so one deployment never loads another's artefact.
CacheDirectory=kimi-supervisor
CacheDirectoryMode=0755
"""

INSTANCE_DIRECTORIES = """\
# /run/kimi-supervisor: every instance's locks, host-wide (GPUs and ports are the host's, and a lock is only
# seen by a supervisor looking in the same directory); /run/kimi-supervisor/%i: this instance's live state
# file. Preserved across stops: a stopped instance's state says how it ended, and the shared directory
# holds the other instances' locks.
RuntimeDirectory=kimi-supervisor kimi-supervisor/%i
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
# /var/lib/kimi-supervisor/%i: this instance's run history, kept across restarts and reboots.
StateDirectory=kimi-supervisor kimi-supervisor/%i
StateDirectoryMode=0755
# /var/cache/kimi-supervisor: vLLM's torch.compile/AOT, Triton, inductor and CUDA JIT caches, kept across
# restarts whoever the child runs as (paths.cache_directory; each child uid gets <dir>/uid-<uid>): without it a
# child without a home recompiles on every start (minutes at TP=8). Shared by the host's deployments: vLLM's
# cache key hashes the model and its whole config, so one deployment never loads another's artefact.
CacheDirectory=kimi-supervisor
CacheDirectoryMode=0755
"""


HOLDER_UNIT_LINES = """\
# The deployment's engine maps these weights: every (re)start of the holder, a reload (a crash, a GPU reset,
# changed flags), starts the engine again, after the holder is ready (the engine's drop-in orders it
# After= and BindsTo= this unit, so stopping the holder stops the engine first).
Wants=kimi-supervisor@%i.service
"""


SPARE_TEMPLATE_NAME = "kimi-supervisor-spare@.service"  # a deployment's hot spare (docs/spare.md)
SPARE_RESTART_SEC = 2  # it maps the held weights: back in seconds; every second without it is a second unguarded

SPARE_UNIT_LINES = """\
# A second engine on the held weights (docs/spare.md): bound to the weight holder like the engine (stopped first
# whenever the holder stops), and started after the engine, so that at boot or after a holder reload the engine
# is served first; it never stops or restarts with the engine, which is the point.
BindsTo=kimi-supervisor-weights@%i.service
After=kimi-supervisor-weights@%i.service kimi-supervisor@%i.service
"""


def systemd_quote(word: str, *, executable: bool = False) -> str:
    """One ExecStart= word, written so systemd reads back exactly `word` (systemd.service(5), "Command
    lines"): `%` is a specifier (`%%`), `$` in an argument an environment reference (`$$`; the executable
    is not substituted), backslash escapes are C-style, and a word with whitespace or quotes is
    double-quoted.  systemd refuses quotes, backslashes and control characters in the executable's path."""
    if executable and any(c in "\\\"'" or ord(c) < 0x20 or ord(c) == 0x7F for c in word):
        raise ServiceUnavailable(
            f"systemd cannot run an executable whose path has quotes, backslashes or control characters: {word!r}"
        )
    out = []
    for c in word:
        if c in '\\"':
            out.append("\\" + c)
        elif c == "%":
            out.append("%%")
        elif c == "$" and not executable:
            out.append("$$")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    text = "".join(out)
    plain = word and text == word and not any(c.isspace() or c in "'\";" for c in word)
    return text if plain else f'"{text}"'


def render(
    exec_argv: Sequence[str] | str = (DEFAULT_EXEC,),
    config_path: Path = DEFAULT_PATH,
    stop_s: int = DEFAULT_STOP_S,
    *,
    template: bool = False,
    writable: Sequence[Path] = (),
    holder: bool = False,
    credentials: Sequence[str] = (),
    doc: Path | None = DEFAULT_DOC,
    serves: str | None = None,
    spare: bool = False,
) -> str:
    """The plain unit running `config_path`; `serves`: what its Description= says it serves (serving(cfg)), a
    template's none (its instances' drop-ins say theirs); `template=True`: the template unit, whose instance NAME runs
    `<config_path's directory>/NAME.toml`.  `writable`: directories the config writes beyond the unit's own
    (ProtectSystem=strict leaves the rest read-only).  `credentials`: the systemd credentials child.credentials
    names (LoadCredential=).  `holder=True`: the weight holder's template, whose
    instance NAME runs NAME.weights.toml.  `doc`: the README that Documentation= names (None: no line).
    `spare=True`: the hot spare's template, whose instance NAME runs NAME.spare.toml (docs/spare.md)."""
    template = template or holder or spare
    role = Role.WEIGHTS if holder else Role.SPARE if spare else Role.ENGINE
    if isinstance(exec_argv, str):
        exec_argv = [exec_argv]
    words = [systemd_quote(exec_argv[0], executable=True)]
    words += [systemd_quote(w) for w in exec_argv[1:]]
    if template:
        # The instance's name goes in as systemd's %i, after the path is quoted (which would make it %%i).
        marker = "KIMIINSTANCEMARKER"
        config_name = role.config_name(marker)
        words += ["--config", systemd_quote(str(config_path.parent / config_name)).replace(marker, "%i")]
    else:
        words += [systemd_quote(w) for w in ["--config", str(config_path)]]
    header = (
        f"# The template: kimi-supervisor@NAME.service runs {config_path.parent}/NAME.toml, one deployment each.\n"
        if template
        else ""
    )
    if holder:
        header = (
            f"# The weight holder's template: kimi-supervisor-weights@NAME.service runs "
            f"{config_path.parent}/NAME.weights.toml\n# (`vllm preload`), whose weights kimi-supervisor@NAME maps.\n"
        )
    if spare:
        header = (
            "# The hot spare's template: kimi-supervisor-spare@NAME.service runs\n"
            f"# {config_path.parent}/NAME.spare.toml "
            "(the engine's argv with its own socket and KV cache, on the held weights: docs/spare.md).\n"
        )
    text = TEXT.format(
        header=header,
        install_args=" --instance NAME" if template and not spare else "",
        serves="" if serves is None or template else f" {serves}",
        what=" weight holder (vllm preload)" if holder else " hot spare" if spare else "",
        unit_extra=HOLDER_UNIT_LINES if holder else SPARE_UNIT_LINES if spare else "",
        description=", deployment %i" if template else "",
        command=" ".join(words),
        config_exit=int(ExitCode.CONFIG),
        reset_exit=int(ExitCode.GPU_NEEDS_RESET),
        restart_sec=SPARE_RESTART_SEC if spare else TEMPLATE_RESTART_SEC,
        stop_s=int(stop_s),
        syslog=f"{unit_template_of(role)}@%i" if template else "kimi-supervisor",
        directories=INSTANCE_DIRECTORIES if template else PLAIN_DIRECTORIES,
        writable=writable_lines(writable),
        credentials=credential_lines(credentials),
        documentation=f"Documentation={doc.as_uri()}\n" if doc is not None else "",
    )
    if spare:  # `systemctl enable` links it into the holder's wants too: every holder (re)start brings it back
        wanted = "WantedBy=multi-user.target kimi-supervisor-weights@%i.service\n"
        text = text.replace("WantedBy=multi-user.target\n", wanted)
    return text


def unit_template_of(role: Role) -> str:
    """The template a role's instance runs under (its SyslogIdentifier= too): its spec's (config/layout.py)."""
    return role_spec.of(role).unit_template or "kimi-supervisor"


def install_spare(config_path: Path, cfg: Config, unit_dir: Path = DEFAULT_UNIT_DIR, reload: bool = True) -> Path:
    """The spare's template and its instance's drop-in (its own TimeoutStopSec= and writable paths)."""
    target = unit_dir / SPARE_TEMPLATE_NAME
    _write(target, render(running_executable(), config_path, spare=True, doc=installed_doc()))
    _write(
        unit_dir / f"kimi-supervisor-spare@{cfg.deployment.name}.service.d" / DROPIN_NAME,
        instance_dropin(
            timeouts.unit_timeout_stop_s(cfg),
            writable_paths(cfg),
            credentials=sorted(set(cfg.child.credentials.values())),
        ),
    )
    if reload:
        _reload(target)
    return target


def installed_doc() -> Path | None:
    """The README this installation put under its prefix (pyproject's data-files), found in the package's
    own record of its files, wherever its prefix is (a venv, ~/.local); an editable install (`pip install -e`)
    installs no data files: then the checkout's README; None when neither is there."""
    readme = DOC_DIR / "README.md"
    try:
        dist = importlib.metadata.distribution("kimi-supervisor")
    except importlib.metadata.PackageNotFoundError:
        files: list[Path] = []
    else:
        files = [Path(os.path.abspath(str(dist.locate_file(f)))) for f in dist.files or []]
    for found in files:
        if found.parts[-len(readme.parts) :] == readme.parts and found.is_file():
            return found
    checkout = Path(__file__).resolve().parents[2] / "README.md"
    return checkout if (checkout.parent / "pyproject.toml").is_file() and checkout.is_file() else None


FRONT_TEMPLATE_NAME = "kimi-supervisor-front@.service"  # a deployment's front (docs/front.md)
FRONT_STOP_S = 30  # its own stop closes connections within 10 s (deployment/front/serve.py SHUTDOWN_S)

FRONT_TEXT = """\
# kimi-supervisor's front (docs/front.md): kimi-supervisor-front@NAME.service runs {config_dir}/NAME.front.toml.
# It owns deployment NAME's public port and forwards to its engine's Unix socket; it is bound to nothing, so
# the engine's restarts (kimi-supervisor@NAME: a crash, the watchdog, systemctl restart) leave it running,
# holding new requests and resuming those in flight.
# Rendered by `kimi-supervisor install-unit --config {config_dir}/NAME.front.toml`; edit the config, not this file.
[Unit]
Description=kimi-supervisor front (the public port; requests held and resumed across engine restarts), deployment %i
{documentation}After=network-online.target
Wants=network-online.target
StartLimitIntervalSec=600
StartLimitBurst=10

[Service]
# READY=1 once it listens, whatever the engine is doing; WATCHDOG=1 from its event loop.
Type=notify
NotifyAccess=main
ExecStart={command}
TimeoutStartSec=30
TimeoutStopSec={stop_s}
WatchdogSec=30
Restart=on-failure
# Every second without it is a second of refused connections: come back at once.
RestartSec=1
RestartPreventExitStatus={config_exit}
SyslogIdentifier=kimi-supervisor-front@%i
LimitNOFILE=1048576
# Its memory is what clients send it (docs/front.md, "Memory"): bounded in its own cgroup, so that past it the
# kernel reclaims and then kills the front (restarted in 1 s), never vLLM; and the host's OOM killer, should it
# run first, picks the front before vLLM. front.max_held_bytes (1 GiB) keeps it well under MemoryHigh.
MemoryHigh=3G
MemoryMax=4G
OOMScoreAdjust=500
# /run/kimi-supervisor: the host's instance locks (its port's among them); /run/kimi-supervisor/%i: the
# engine's state file it reads and the engine's socket directory, front/, which the engine's unit makes.
RuntimeDirectory=kimi-supervisor kimi-supervisor/%i
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
StateDirectory=kimi-supervisor kimi-supervisor/%i
StateDirectoryMode=0755

# Hardening: a network proxy, no GPU, no child. It starts as root for the instance locks and the port, makes
# the engine's socket directory and its own state directory for its account (CHOWN, then FOWNER for the mode
# of what is no longer root's), then drops to that account (SETUID/SETGID: front.user, else the engine's
# child.user) before it serves: every capability goes with root (docs/front.md, "Who it runs as").
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
PrivateDevices=yes
PrivateMounts=yes
ProtectProc=invisible
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
CapabilityBoundingSet=CAP_NET_BIND_SERVICE CAP_SETUID CAP_SETGID CAP_CHOWN CAP_FOWNER
SystemCallFilter=@system-service
SystemCallFilter=~@mount @reboot @swap @module @raw-io @obsolete @cpu-emulation @clock @debug
SystemCallErrorNumber=EPERM
UMask=0077

[Install]
WantedBy=multi-user.target
"""


def render_front(
    exec_argv: Sequence[str] | str = (DEFAULT_EXEC,),
    config_dir: Path = DEFAULT_PATH.parent,
    doc: Path | None = DEFAULT_DOC,
) -> str:
    """The front's template: instance NAME runs `<config_dir>/NAME.front.toml` (docs/front.md).  `doc`: the
    installed README; Documentation= names docs/front.md beside it (None: no line)."""
    if isinstance(exec_argv, str):
        exec_argv = [exec_argv]
    words = [systemd_quote(exec_argv[0], executable=True)] + [systemd_quote(w) for w in exec_argv[1:]]
    marker = "KIMIINSTANCEMARKER"
    words += ["--config", systemd_quote(str(config_dir / Role.FRONT.config_name(marker))).replace(marker, "%i")]
    return FRONT_TEXT.format(
        config_dir=config_dir,
        command=" ".join(words),
        stop_s=FRONT_STOP_S,
        config_exit=int(ExitCode.CONFIG),
        documentation=f"Documentation={(doc.parent / 'docs' / 'front.md').as_uri()}\n" if doc is not None else "",
    )


def install_front(config_path: Path, unit_dir: Path = DEFAULT_UNIT_DIR, reload: bool = True) -> Path:
    """Write the front's template for `config_path`'s directory and reload systemd."""
    target = unit_dir / FRONT_TEMPLATE_NAME
    refuse_other_directory(target, config_path.parent)
    _write(target, render_front(running_executable(), config_path.parent, installed_doc()))
    if reload:
        _reload(target)
    return target


def writable_paths(cfg: Config) -> list[Path]:
    """The directories `cfg` writes that ProtectSystem=strict would leave read-only: the metrics textfile's,
    [paths] moved off the unit's own directories, and child.user's home when not under /root or /home (vLLM's
    caches)."""
    found: list[Path] = []
    if cfg.metrics.textfile is not None:
        found.append(cfg.metrics.textfile.parent)
    defaults = {cfg.paths.runtime_directory: Path("/run/kimi-supervisor"), cfg.paths.state_directory: STATE_DIR}
    if cfg.paths.cache_directory is not None:
        defaults[cfg.paths.cache_directory] = Path("/var/cache/kimi-supervisor")
    found += [directory for directory, default in defaults.items() if directory != default]
    if cfg.child.user is not None:
        with contextlib.suppress(KeyError):
            home = Path(pwd.getpwnam(cfg.child.user).pw_dir)
            if not any(home == top or top in home.parents for top in (Path("/root"), Path("/home"))):
                found.append(home)
    return sorted(set(found))


def writable_lines(writable: Sequence[Path]) -> str:
    if not writable:
        return ""
    # "-": a directory missing at start is no error (the supervisor then warns it cannot write there).
    paths = " ".join(systemd_quote("-" + str(p)) for p in writable)
    return f"# What this config writes outside the unit's own directories.\nReadWritePaths={paths}\n"


def credential_lines(credentials: Sequence[str]) -> str:
    if not credentials:
        return ""
    # By name alone: systemd reads /etc/credstore/NAME (or /run/credstore, /usr/lib/credstore; the
    # .encrypted stores for LoadCredentialEncrypted=) into $CREDENTIALS_DIRECTORY, readable by this unit only.
    lines = "".join(f"LoadCredential={systemd_quote(name)}\n" for name in credentials)
    return "# The child's secrets (child.credentials), into its environment only (docs/configuration.md).\n" + lines


def serving(cfg: Config) -> str:
    """What a unit's Description= says it serves, from its config: vLLM's served model name (else its model) and
    its tensor-parallel size (was: "Kimi-K2.5 NVFP4 (TP=8)" for every config)."""
    vllm = cfg.child.vllm
    text = f"{vllm.served_name or vllm.model or 'a model'} (TP={vllm.tensor_parallel_size})"
    # One line of a unit file, where `%` starts a specifier.
    return "".join(c if c.isprintable() else "?" for c in text).replace("%", "%%")


def instance_dropin(
    stop_s: int,
    writable: Sequence[Path],
    holder_unit: str | None = None,
    credentials: Sequence[str] = (),
    description: str | None = None,
) -> str:
    """What one instance's config adds to the template (install-unit --instance NAME); `holder_unit`: the
    deployment's weight holder, which the engine maps (`[weights] holder = true`); `description`: its
    Description= (the template's names no model: it serves every instance)."""
    bind = restart = ""
    if description is not None:
        bind = f"Description={description}\n"
    if holder_unit is not None:
        bind += (
            "# This engine maps its weight holder's weights: started once the holder is ready, stopped\n"
            "# (first) whenever the holder stops; its own restarts never touch the holder.\n"
            f"BindsTo={holder_unit}\nAfter={holder_unit}\n"
        )
        restart = (
            "# A restart maps the held weights instead of reading them (seconds, not minutes): the template's\n"
            f"# {TEMPLATE_RESTART_SEC} s would be most of it.  StartLimitBurst= still ends a crash loop.\n"
            f"RestartSec={HOLDER_ENGINE_RESTART_SEC}\n"
        )
    if bind:
        bind = "[Unit]\n" + bind
    return (
        "# Rendered by `kimi-supervisor install-unit --instance`: this instance's own settings, from its config.\n"
        f"{bind}[Service]\nTimeoutStopSec={int(stop_s)}\n{restart}{writable_lines(writable)}"
        f"{credential_lines(credentials)}"
    )


@dataclasses.dataclass(frozen=True)
class HolderUnit:
    """The weight holder's share of `install`: its own TimeoutStopSec=, writable paths and Description=, from its
    config."""

    stop_s: int
    writable: Sequence[Path] = ()
    serves: str | None = None


def running_executable(argv0: str | None = None, python: str | None = None) -> list[str]:
    """The command that runs *this* installation: our console script when that is what runs, else
    `python -m kimi_supervisor` with this interpreter.  Never a lookup on PATH: under sudo it lacks the
    venv, and with two installs it finds the other one."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    script = os.path.realpath(argv0) if argv0 else ""
    if os.path.basename(argv0) == "kimi-supervisor" and os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    # The interpreter is not resolved: a venv's python is a symlink, and only its own path selects the venv.
    return [os.path.abspath(python or sys.executable), "-m", "kimi_supervisor"]


def install(
    config_path: Path,
    unit_dir: Path = DEFAULT_UNIT_DIR,
    reload: bool = True,
    exec_argv: Sequence[str] | None = None,
    stop_s: int = DEFAULT_STOP_S,
    *,
    instance: str | None = None,
    writable: Sequence[Path] = (),
    holder: HolderUnit | None = None,
    credentials: Sequence[str] = (),
    serves: str | None = None,
    front: bool = False,
) -> list[Path]:
    """Write the units and reload systemd; returns the paths of the units written, the engine's last.  With
    `instance`: the template unit (for `config_path`'s directory) and the instance's drop-in with its own
    TimeoutStopSec=, paths and Description=.  With `holder` (and `instance`): the weight holder's template and
    drop-in too, the engine bound to it; with `front`: the front's template (docs/front.md).  A template that
    runs another directory's configs is refused before anything is written (its instances would be moved)."""
    argv = running_executable() if exec_argv is None else exec_argv
    doc = installed_doc()
    config_dir = config_path.parent
    if instance is None:
        target = unit_dir / UNIT_NAME
        _write(
            target,
            render(argv, config_path, stop_s, writable=writable, credentials=credentials, doc=doc, serves=serves),
        )
        if reload:
            _reload(target)
        return [target]
    target = unit_dir / TEMPLATE_NAME
    templates = [(target, render(argv, config_path, template=True, doc=doc))]
    if holder is not None:
        templates.insert(0, (unit_dir / HOLDER_TEMPLATE_NAME, render(argv, config_path, holder=True, doc=doc)))
    if front:
        templates.insert(-1, (unit_dir / FRONT_TEMPLATE_NAME, render_front(argv, config_dir, doc)))
    for path, _ in templates:
        refuse_other_directory(path, config_dir)
    holder_unit = f"kimi-supervisor-weights@{instance}.service" if holder is not None else None
    if holder is not None:
        holder_says = None
        if holder.serves is not None:
            holder_says = f"vLLM {holder.serves} weight holder (vllm preload) supervised by kimi-supervisor"
            holder_says += f", deployment {instance}"
        _write(
            unit_dir / f"{holder_unit}.d" / DROPIN_NAME,
            instance_dropin(holder.stop_s, holder.writable, description=holder_says),
        )
    for path, text in templates:
        _write(path, text)
    engine_says = None if serves is None else f"vLLM {serves} supervised by kimi-supervisor, deployment {instance}"
    _write(
        unit_dir / f"kimi-supervisor@{instance}.service.d" / DROPIN_NAME,
        instance_dropin(stop_s, writable, holder_unit, credentials, engine_says),
    )
    if reload:
        _reload(target)
    return [path for path, _ in templates]


def refuse_other_directory(template: Path, config_dir: Path) -> None:
    """A template's instance NAME runs `<its directory>/NAME...toml`: one directory for every instance.  Written
    again for a config of another directory, it would point the instances installed before at files that are not
    there (was: rewritten silently, the first instance's next start failed); so it is refused, exit 78."""
    try:
        text = template.read_text()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise NoPermission(f"cannot read {template}: {exc.strerror}") from None
    theirs = _config_directory(text)
    if theirs is None or theirs == config_dir:
        return
    instances = sorted(p.name.removesuffix(".d") for p in template.parent.glob(template.name.replace("@", "@*") + ".d"))
    which = f" ({', '.join(instances)})" if instances else ""
    raise ConfigError(
        f"{template} runs its instances' configs from {theirs}{which}, not {config_dir}: put this config in "
        f"{theirs}, or remove {template} first if no instance runs from {theirs}"
    )


def _config_directory(text: str) -> Path | None:
    """The directory a rendered template's ExecStart= reads its instances' configs from (`--config DIR/%i...`)."""
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            try:
                words = shlex.split(line.removeprefix("ExecStart="))
            except ValueError:
                return None
            if "--config" in words[:-1]:
                return Path(words[words.index("--config") + 1].replace("%%", "%")).parent
    return None


def _reload(target: Path) -> None:
    try:
        result = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceUnavailable(f"wrote {target}, but systemctl daemon-reload could not run: {exc}") from None
    if result.returncode != 0:
        why = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        denied = ("Access denied", "Permission denied", "Interactive authentication required")
        error = NoPermission if any(d in why for d in denied) else ServiceUnavailable
        raise error(f"wrote {target}, but systemctl daemon-reload failed: {why}")


def _write(target: Path, text: str) -> None:
    tmp = target.with_suffix(".tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        hint = " (run it as root: sudo kimi-supervisor install-unit)" if os.geteuid() != 0 else ""
        raise NoPermission(f"cannot write {target}: {exc.strerror}{hint}") from None
