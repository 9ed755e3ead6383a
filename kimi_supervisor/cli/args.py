"""The command line's grammar: each command takes only its own options (`parse_args`), with one help each."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, NoReturn

from kimi_supervisor import __version__
from kimi_supervisor.config.load import DEFAULT_PATH
from kimi_supervisor.exitcodes import DESCRIPTIONS, ExitCode
from kimi_supervisor.logs.journal import FORMATS
from kimi_supervisor.systemd import unit

# (command, what it does): --help's examples, and the man page's EXAMPLES (packaging/generate_shell_files.py).
EXAMPLES = (
    ("kimi-supervisor --dry-run", "what a start would do now, changing nothing"),
    ("kimi-supervisor check-config", "validate and print the effective config"),
    ("kimi-supervisor status --watch", "loading progress and ETA until ready"),
    ("systemctl start kimi-supervisor", "run it as the Type=notify unit"),
    ("journalctl -u kimi-supervisor -p warning", "what went wrong"),
)
EPILOG = (
    "exit codes:\n"
    + "\n".join(f"  {int(c):>3}  {DESCRIPTIONS[c]}" for c in sorted(DESCRIPTIONS))
    + "\n\nexamples:\n"
    + "".join(f"  {command:<40}  {what}\n" for command, what in EXAMPLES)
)


COMMANDS = ("run", "check-config", "install-unit", "status")
COMPLETE_DEPLOYMENTS = "_kimi_supervisor_deployments"  # the shell function that lists `status NAME`'s names
# Options that take a value: their value is never mistaken for the command word (`--config status`).
_VALUED = ("--config", "--log-format", "--log-level", "--unit-dir", "--instance")
_DEFAULTS = {
    "dry_run": False,
    "json": False,
    "watch": False,
    "log_format": "auto",
    "log_level": "info",
    "unit_dir": unit.DEFAULT_UNIT_DIR,
    "no_reload": False,
    "name": None,
    "instance": None,
}


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (argparse prints the whole usage first), naming the command that owns a
    misplaced option; exit 2."""

    owners: ClassVar[dict[str, list[str]]] = {}  # option -> the commands that take it (parse_args fills it)
    command = "run"

    def error(self, message: str) -> NoReturn:
        words = message.split() if message.startswith("unrecognized arguments") else []
        hints = [
            f"{opt} belongs to {' and '.join(self.owners[opt])}"
            for opt in self.owners
            if opt in words and self.command not in self.owners[opt]
        ]
        hint = f" ({'; '.join(hints)})" if hints else ""
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}{hint}; see {self.prog} --help\n")


def _command_parser(command: str) -> _Parser:
    """Each command takes only its own options: an option of another one is a usage error, never ignored."""
    helps = {
        "run": "preflight, start and supervise (the default command)",
        "check-config": "validate and print the effective config",
        "install-unit": "write the systemd unit for this config and daemon-reload",
        "status": "what the running service is doing, and its last runs (no root needed)",
    }
    if command == "run":
        p = _Parser(
            prog="kimi-supervisor",
            usage="kimi-supervisor [run] [--config PATH] [--dry-run [--json]] [--log-format F] [--log-level L]\n"
            "       kimi-supervisor check-config [--config PATH] [--json]\n"
            "       kimi-supervisor install-unit [--config PATH] [--instance NAME] [--unit-dir DIR] [--no-reload]\n"
            "       kimi-supervisor status [NAME | --config PATH] [--json] [--watch]",
            description="Run `vllm serve` as a systemd Type=notify service: free the GPUs (preflight), start vLLM, "
            "send READY=1 only once /health answers, ping the watchdog while healthy, stop the whole "
            "process tree.\n\ncommands:\n" + "\n".join(f"  {c:<13} {h}" for c, h in helps.items()),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
        )
        p.add_argument("--version", action="version", version=f"kimi-supervisor {__version__}")
    else:
        p = _Parser(prog=f"kimi-supervisor {command}", description=helps[command], allow_abbrev=False)
    p.command = command
    p.set_defaults(command=command, **_DEFAULTS)
    if command == "install-unit":
        # No fixed default: an --instance NAME's config is NAME.toml (parse_args fills it in).
        p.add_argument(
            "--config",
            type=Path,
            default=None,
            metavar="PATH",
            help=f"TOML config file (default: {DEFAULT_PATH}; with --instance NAME: {DEFAULT_PATH.parent}/NAME.toml)",
        )
    elif command == "status":
        # No default: without --config (or NAME) status looks at every deployment configured on the host.
        p.add_argument(
            "--config",
            type=Path,
            default=None,
            metavar="PATH",
            help=f"TOML config file (default: every *.toml in {DEFAULT_PATH.parent}, one line each when several)",
        )
        name = p.add_argument("name", nargs="?", default=None, metavar="NAME", help="the deployment to show (its name)")
        # shtab's hook (packaging/generate_shell_files.py defines the function): the deployments' names, completed.
        name.complete = {"bash": COMPLETE_DEPLOYMENTS, "zsh": COMPLETE_DEPLOYMENTS}  # type: ignore[attr-defined]
    else:
        p.add_argument(
            "--config",
            type=Path,
            default=DEFAULT_PATH,
            metavar="PATH",
            help=f"TOML config file (default: {DEFAULT_PATH})",
        )
    if command == "run":
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="run every preflight check, kill and delete nothing, print a report; "
            "exit 0 only if a real start would proceed",
        )
    if command in ("run", "check-config", "status"):
        p.add_argument("--json", action="store_true", help="print JSON" + (" (with --dry-run)" * (command == "run")))
    if command == "status":
        p.add_argument("--watch", action="store_true", help="refresh every second until ready")
    if command == "run":
        p.add_argument(
            "--log-format",
            choices=FORMATS,
            default="auto",
            help="auto (default): journal under systemd, console on a terminal, else json",
        )
        p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    if command == "install-unit":
        p.add_argument(
            "--unit-dir",
            type=Path,
            default=unit.DEFAULT_UNIT_DIR,
            metavar="DIR",
            help=f"where to write {unit.UNIT_NAME} (default: {unit.DEFAULT_UNIT_DIR})",
        )
        p.add_argument(
            "--instance",
            metavar="NAME",
            help=f"write the template {unit.TEMPLATE_NAME} and instance NAME's drop-in instead "
            "(kimi-supervisor@NAME runs NAME.toml beside --config; one per deployment of a host)",
        )
        p.add_argument("--no-reload", action="store_true", help="skip systemctl daemon-reload")
    return p


def _owners() -> dict[str, list[str]]:
    owners: dict[str, list[str]] = {}
    for command in COMMANDS:
        for action in _command_parser(command)._actions:
            for opt in action.option_strings:
                owners.setdefault(opt, []).append(command)
    return owners


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command word may come anywhere (`--config X status` as before); no word means `run`."""
    argv = list(argv)
    command, rest, skip = "run", list(argv), False
    for i, token in enumerate(argv):
        if skip:
            skip = False
        elif token == "--":
            break
        elif token in _VALUED:
            skip = True
        elif not token.startswith("-"):
            if token in COMMANDS:
                command, rest = token, argv[:i] + argv[i + 1 :]
            break  # any other word: the command's parser says it is not one
    _Parser.owners = _owners()
    args = _command_parser(command).parse_args(rest)
    if command == "install-unit" and args.config is None:
        args.config = DEFAULT_PATH if args.instance is None else DEFAULT_PATH.parent / f"{args.instance}.toml"
    if args.json and command == "run" and not args.dry_run:
        _command_parser(command).error("--json needs --dry-run (a run writes log records, not a report)")
    return args


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (`run`'s, whose help lists every command)."""
    return _command_parser("run")


def whole_parser() -> argparse.ArgumentParser:
    """Every command as a subcommand of one parser, each with exactly the options `parse_args` gives it: the
    shape shtab and argparse-manpage read to write the shell completion and the man page
    (packaging/generate_shell_files.py). Never used to parse: the command word may come anywhere, which
    subparsers do not allow."""
    top = _command_parser("run")
    top.usage = None  # run's hand-written usage lists every command: the subparsers' own usages say it here
    sub = top.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for command in COMMANDS:
        own = _command_parser(command)
        # The help of each command is the description its own parser shows; `run` keeps only its options.
        helps = own.description if command != "run" else "preflight, start and supervise (the default command)"
        sub.add_parser(command, parents=[own], add_help=False, help=helps, description=helps)
    return top
