"""Exit codes and the exception that carries them.

Every failure the supervisor knows about is a `SupervisorError` subclass that
names its exit code; `cli.main` catches them once.  Codes are distinct so that
`systemctl status` / `journalctl` show *why* a run ended, and so the unit can
refuse to restart on the ones a restart cannot fix (config errors: 78; a GPU that needs a reset: 22).
"""

from __future__ import annotations

import enum

from kimi_supervisor.quoting import escape_controls


class ExitCode(enum.IntEnum):
    OK = 0  # stopped on request, or a dry run that would start
    INTERNAL = 70  # EX_SOFTWARE: a bug; the traceback is logged
    USAGE = 2  # bad command line (argparse's own code)
    NOT_RUNNING = 3  # `status`: the supervisor is not running (as `systemctl status` says of an inactive unit)
    STATUS_UNKNOWN = 4  # `status NAME`: no deployment of that name (LSB: "program or service status is unknown")
    PREFLIGHT_FAILED = 10  # GPUs never freed, deployment cannot start
    STARTUP_FAILED = 11  # child printed a fatal line or exited while loading
    STARTUP_STALLED = 12  # no output for stall_timeout_s, or past deadline_s
    CHILD_DIED = 13  # child exited after READY without being asked to
    CHILD_UNHEALTHY = 14  # /health failed failures_tolerated times in a row
    SPAWN_FAILED = 15  # argv[0] missing, bad user, bad working directory
    ANOTHER_INSTANCE = 16  # another kimi-supervisor owns these GPUs; nothing was changed
    ENGINE_WEDGED = 17  # /health answers but the engine makes no progress (canary or metrics)
    GPU_FAILED = 18  # NVML reported a device-level XID / uncorrectable ECC event on one of our GPUs
    PEER_LOST = 19  # leader: a follower of its group is gone; the group restarts from this end
    LEADER_LOST = 20  # follower: its leader did not come back within cluster's bounded wait
    WEIGHTS_UNAVAILABLE = 21  # engine: its weight holder was not ready within the deadline; nothing killed
    GPU_NEEDS_RESET = 22  # a process on our GPUs survives SIGKILL (stuck in the driver): the unit must not restart
    UNAVAILABLE = 69  # EX_UNAVAILABLE: systemd cannot take the unit (daemon-reload failed, unusable path)
    NO_PERMISSION = 77  # EX_NOPERM: a file or directory the command needs cannot be written
    CONFIG = 78  # EX_CONFIG: the unit must not restart on this
    INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C outside a supervised run (a --dry-run), as shells report it


DESCRIPTIONS: dict[ExitCode, str] = {
    ExitCode.OK: "stopped on request; or --dry-run: a start would proceed",
    ExitCode.USAGE: "bad command-line arguments",
    ExitCode.NOT_RUNNING: "status: the supervisor is not running",
    ExitCode.STATUS_UNKNOWN: "status NAME: no deployment of that name on this host",
    ExitCode.PREFLIGHT_FAILED: "preflight failed: GPUs busy past the deadline, or a deployment check failed",
    ExitCode.STARTUP_FAILED: "vLLM failed while starting (fatal log line or exit before ready)",
    ExitCode.STARTUP_STALLED: "vLLM printed nothing for stall_timeout_s, or was not ready by deadline_s",
    ExitCode.CHILD_DIED: "vLLM exited after ready without being asked to (even with status 0)",
    ExitCode.CHILD_UNHEALTHY: "/health failed failures_tolerated consecutive times after ready",
    ExitCode.SPAWN_FAILED: "the child could not be started (argv[0], user or working directory)",
    ExitCode.ANOTHER_INSTANCE: "another kimi-supervisor owns these GPUs (its PID is named); nothing was changed",
    ExitCode.ENGINE_WEDGED: "vLLM answers /health but its engine is wedged (canary or token progress failed)",
    ExitCode.GPU_FAILED: "a GPU of ours reported a device-level XID or uncorrectable ECC error while serving",
    ExitCode.PEER_LOST: "leader: a follower of the multi-node group was lost (vLLM or host); the group restarts",
    ExitCode.LEADER_LOST: "follower: the group's leader did not come back within the bounded wait",
    ExitCode.WEIGHTS_UNAVAILABLE: "the deployment's weight holder was not ready within the deadline; nothing killed",
    ExitCode.GPU_NEEDS_RESET: "a process on our GPUs survives SIGKILL (stuck in the kernel): reset the GPU or reboot",
    ExitCode.UNAVAILABLE: "install-unit: systemctl daemon-reload failed, or systemd cannot run this path",
    ExitCode.NO_PERMISSION: "permission denied writing a file the command needs (e.g. install-unit without root)",
    ExitCode.INTERNAL: "internal error (a bug): the traceback is in the journal",
    ExitCode.CONFIG: "configuration error (systemd does not restart on it)",
    ExitCode.INTERRUPTED: "interrupted by Ctrl-C (SIGINT) during --dry-run or check-config; nothing was changed",
}


def exit_outcome(exc: BaseException) -> tuple[ExitCode | int, str]:
    """The exit code `cli.main` gives for `exc`, and the reason the run's record states (docs/operators-view.md).

    One table for both, so the state file and the history never disagree with the exit status.
    """
    text = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, SupervisorError):
        return exc.exit_code, exc.message
    declared = getattr(type(exc), "exit_code", None)  # gpu.GpuUnavailable: imported here it would be a cycle
    if isinstance(declared, ExitCode):
        return declared, f"{getattr(type(exc), 'reason', type(exc).__name__)}: {exc}"[:300]
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED, "interrupted (KeyboardInterrupt)"
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, f"SystemExit({exc.code!r:.80})"
    if isinstance(exc, BrokenPipeError):
        return ExitCode.OK, "stdout or stderr closed by its reader (BrokenPipeError)"
    return ExitCode.INTERNAL, f"internal error (a bug; the traceback is in the journal): {text}"


class SupervisorError(Exception):
    """An expected failure: one line of text plus the process exit code."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, detail: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Extra lines (e.g. the child's last output) logged after the message.
        self.detail: list[str] = list(detail or [])


class ConfigError(SupervisorError):
    exit_code = ExitCode.CONFIG

    def __init__(self, message: str, *, detail: list[str] | None = None) -> None:
        # One line, always: a newline in a key, value or path (all attacker-chosen) must not fake a second one.
        super().__init__(escape_controls(message), detail=detail)


class DeploymentUnknown(SupervisorError):
    """`status NAME` for a name no deployment of the host has: the LSB code for an unknown status, not a
    config error (nothing is wrong with any config; a script asked about something that is not there)."""

    exit_code = ExitCode.STATUS_UNKNOWN


class NoPermission(SupervisorError):
    exit_code = ExitCode.NO_PERMISSION


class ServiceUnavailable(SupervisorError):
    exit_code = ExitCode.UNAVAILABLE


class PreflightError(SupervisorError):
    exit_code = ExitCode.PREFLIGHT_FAILED


class SpawnError(SupervisorError):
    exit_code = ExitCode.SPAWN_FAILED


class StartupFailed(SupervisorError):
    exit_code = ExitCode.STARTUP_FAILED


class StartupStalled(SupervisorError):
    exit_code = ExitCode.STARTUP_STALLED


class ChildDied(SupervisorError):
    exit_code = ExitCode.CHILD_DIED


class ChildUnhealthy(SupervisorError):
    exit_code = ExitCode.CHILD_UNHEALTHY


class AnotherInstance(SupervisorError):
    exit_code = ExitCode.ANOTHER_INSTANCE


class RuntimeDirectoryError(SupervisorError):
    exit_code = ExitCode.NO_PERMISSION


class EngineWedged(SupervisorError):
    exit_code = ExitCode.ENGINE_WEDGED


class GpuFailed(SupervisorError):
    exit_code = ExitCode.GPU_FAILED


class PeerLost(SupervisorError):
    exit_code = ExitCode.PEER_LOST


class LeaderLost(SupervisorError):
    exit_code = ExitCode.LEADER_LOST


class WeightsUnavailable(SupervisorError):
    exit_code = ExitCode.WEIGHTS_UNAVAILABLE


class GpuNeedsReset(SupervisorError):
    """A process of our tree (or a stale one the preflight reaped) outlived SIGKILL: a restart cannot free its GPUs."""

    exit_code = ExitCode.GPU_NEEDS_RESET


class ThreadDied(SupervisorError):
    """One of our check threads (canary, health prober, metrics, GPU events) died: a bug, exit 70."""

    exit_code = ExitCode.INTERNAL
