"""The systemd unit: one template, rendered for packaging/ and by `install-unit`.

packaging/systemd/kimi-supervisor.service is this template rendered with the
defaults (a test keeps them identical); `kimi-supervisor install-unit` renders
it with the real path of the installed executable and reloads systemd.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kimi_supervisor.config import DEFAULT_PATH
from kimi_supervisor.exitcodes import ExitCode, SupervisorError

UNIT_NAME = "kimi-supervisor.service"
DEFAULT_EXEC = "/usr/local/bin/kimi-supervisor"
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")

TEMPLATE = """\
# kimi-supervisor: vLLM serving Kimi-K2.5-NVFP4 (TP=8) as a Type=notify service.
# Rendered by `kimi-supervisor install-unit`; edit the config, not this file.
[Unit]
Description=vLLM Kimi-K2.5 NVFP4 (TP=8) supervised by kimi-supervisor
Documentation=file:///usr/share/doc/kimi-supervisor/README.md
# The driver's persistence daemon keeps GPUs initialised; the API needs the network.
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
# Five failed starts within an hour stop the restart loop (a 9-minute load each).
StartLimitIntervalSec=3600
StartLimitBurst=5

[Service]
Type=notify
# Only the supervisor speaks sd_notify; vLLM's processes must not.
NotifyAccess=main
ExecStart={exec_path} --config {config_path}
# First window only: the supervisor extends it (EXTEND_TIMEOUT_USEC) while vLLM makes progress.
TimeoutStartSec=180
# shutdown.grace_s (30) + vLLM worker shutdown (~8 s) + SIGKILL wait (5) + GPU release check (30) + margin.
TimeoutStopSec=90
# Pinged only while GET /health passes; a hung server is killed and restarted.
WatchdogSec=60
# SIGTERM to the supervisor alone (it stops its tree in order), then SIGKILL to whatever is left.
KillMode=mixed
Restart=on-failure
RestartSec=15
# 78 = configuration error: restarting cannot fix it.
RestartPreventExitStatus={config_exit}
# vLLM pins host memory for GPU transfers and opens many files (119 shards, sockets).
LimitMEMLOCK=infinity
LimitNOFILE=1048576
# Journal lines keep their priority (the supervisor sends native journal records).
SyslogIdentifier=kimi-supervisor
# journald rate-limits per unit and priority; a chatty vLLM used up the default (10000 per 30 s) and the
# supervisor's own records (state.*, stop.*) were dropped. The supervisor forwards at most 4000 child lines
# a second per priority (the rest are counted in "child.suppressed" records): at most 44000 in any 10 s
# window, so this burst always leaves room for its own records.
LogRateLimitIntervalSec=10s
LogRateLimitBurst=60000
# /run/kimi-supervisor: the instance lock and the live state file. Preserved across stops: removing it
# while another instance (started from a shell) holds its lock would let a third one in beside it.
RuntimeDirectory=kimi-supervisor
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
# /var/lib/kimi-supervisor: the run history, kept across restarts and reboots.
StateDirectory=kimi-supervisor
StateDirectoryMode=0755

# Hardening that vLLM still runs under (see README, "Hardening").
NoNewPrivileges=yes
ProtectSystem=full
PrivateTmp=yes
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
# other processes' /proc fds and maps; FOWNER: remove others' files in sticky /dev/shm; IPC_LOCK: memlock;
# DAC_OVERRIDE: a root child reads model files and caches whatever their mode.
CapabilityBoundingSet=CAP_KILL CAP_SETUID CAP_SETGID CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_IPC_LOCK \\
    CAP_DAC_OVERRIDE
# Allow-list of the syscalls ordinary services use, minus groups vLLM never needs; a blocked call
# fails with EPERM instead of killing the server. (@resources stays: torch sets CPU affinity.)
SystemCallFilter=@system-service
SystemCallFilter=~@mount @reboot @swap @module @raw-io @obsolete @cpu-emulation @clock @debug
SystemCallErrorNumber=EPERM
# Caches and logs the server writes are not world-readable.
UMask=0027
# Not set, because vLLM breaks: MemoryDenyWriteExecute (Triton/torch.compile JIT), PrivateDevices
# (/dev/nvidia*), ProtectHome (model venv and caches under /root), PrivateNetwork and IPAddressDeny (it
# serves clients), ProtectProc=invisible (the preflight must see stale processes of every user).

[Install]
WantedBy=multi-user.target
"""


def render(exec_path: str = DEFAULT_EXEC, config_path: Path = DEFAULT_PATH) -> str:
    for name, value in (("executable", exec_path), ("config", str(config_path))):
        if any(c.isspace() for c in value) or "%" in value or "$" in value:
            raise SupervisorError(f"{name} path {value!r} contains whitespace, % or $: use a plain path")
    return TEMPLATE.format(exec_path=exec_path, config_path=config_path, config_exit=int(ExitCode.CONFIG))


def installed_executable() -> str:
    found = shutil.which("kimi-supervisor")
    if found:
        return os.path.realpath(found) if os.path.islink(found) else found
    return f"{sys.executable} -m kimi_supervisor"


def install(config_path: Path, unit_dir: Path = DEFAULT_UNIT_DIR, reload: bool = True) -> Path:
    """Write the unit and reload systemd; returns the unit's path."""
    exe = installed_executable()
    if " " in exe:
        raise SupervisorError(
            "the kimi-supervisor executable is not on PATH; install the package first (python3 -m pip install .)"
        )
    text = render(exe, config_path)
    target = unit_dir / UNIT_NAME
    try:
        unit_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(target)
    except OSError as exc:
        raise SupervisorError(f"cannot write {target}: {exc.strerror}") from None
    if reload:
        result = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True)
        if result.returncode != 0:
            raise SupervisorError(f"systemctl daemon-reload failed: {result.stderr.strip() or result.returncode}")
    return target
