"""Write the shell completion and the man page from the argparse parser (cli/args.py: whole_parser).

    python3 packaging/generate_shell_files.py          # rewrite the files below
    python3 packaging/generate_shell_files.py --check  # exit 1 when one is out of date (tests/cli/test_shell_files.py)

shtab and argparse-manpage are build-time tools (the dev extra), not runtime dependencies: the generated files
are committed and installed as data files (pyproject's [tool.setuptools.data-files]), so a host needs neither.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kimi_supervisor.cli.args import COMPLETE_DEPLOYMENTS, EXAMPLES, whole_parser  # noqa: E402
from kimi_supervisor.exitcodes import DESCRIPTIONS  # noqa: E402

OUTPUTS = {
    # Named as bash-completion and zsh look them up (by the command's name), installed as they are.
    "bash": HERE / "completion" / "bash" / "kimi-supervisor",
    "zsh": HERE / "completion" / "zsh" / "_kimi-supervisor",
    "man": HERE / "man" / "kimi-supervisor.1",
    # The config file's page, from docs/configuration.md's key tables (one source for both).
    "man5": HERE / "man" / "kimi-supervisor.toml.5",
}
CONFIGURATION = HERE.parent / "docs" / "configuration.md"

MAN_DATA = {
    "project_name": "kimi-supervisor",
    "manual_section": "1",
    "manual_title": "kimi-supervisor manual",
    "description": "run vLLM as a well-behaved systemd Type=notify service",
}


# `status NAME`: the names of the deployments configured in /etc/kimi-supervisor (NAME.toml, and its holder's and
# front's NAME.weights.toml, NAME.front.toml) and of those with a state file under /run/kimi-supervisor, read from
# the file names (no command runs at a Tab); KIMI_SUPERVISOR_CONFIG_DIR and KIMI_SUPERVISOR_RUNTIME_DIR move them.
PREAMBLE = {
    "bash": f"""\
{COMPLETE_DEPLOYMENTS}() {{
  local etc="${{KIMI_SUPERVISOR_CONFIG_DIR:-/etc/kimi-supervisor}}"
  local run="${{KIMI_SUPERVISOR_RUNTIME_DIR:-/run/kimi-supervisor}}"
  local f n names=()
  for f in "$etc"/*.toml "$run"/*/state.json; do
    [ -e "$f" ] || continue
    case "$f" in
      */state.json) n="${{f%/state.json}}"; n="${{n##*/}}" ;;
      *) n="${{f##*/}}"; n="${{n%.toml}}"; n="${{n%.front}}"; n="${{n%.weights}}" ;;
    esac
    names+=("$n")
  done
  compgen -W "${{names[*]}}" -- "$1" | sort -u
}}
""",
    "zsh": f"""\
{COMPLETE_DEPLOYMENTS}() {{
  local etc="${{KIMI_SUPERVISOR_CONFIG_DIR:-/etc/kimi-supervisor}}"
  local run="${{KIMI_SUPERVISOR_RUNTIME_DIR:-/run/kimi-supervisor}}"
  local -a names
  names=("$etc"/*.toml(N:t:r) "$run"/*/state.json(N:h:t))
  names=(${{(u)${{names%.weights}}%.front}})
  compadd -a names
}}
""",
}


FILES = (
    ("/etc/kimi-supervisor/kimi-supervisor.toml", "the default config (kimi-supervisor.toml(5)), the plain unit's"),
    (
        "/etc/kimi-supervisor/NAME.toml",
        "deployment NAME's engine (kimi-supervisor@NAME); beside it NAME.weights.toml, its weight holder's "
        "(kimi-supervisor-weights@NAME), and NAME.front.toml, its front's (kimi-supervisor-front@NAME)",
    ),
    ("/run/kimi-supervisor/NAME/state.json", "the live state kimi-supervisor status reads (the locks beside NAME/)"),
    ("/var/lib/kimi-supervisor/NAME/history.json", "the run history: each run's start, load, end and exit"),
    (
        "/etc/systemd/system/kimi-supervisor.service",
        "and kimi-supervisor@.service, kimi-supervisor-weights@.service, kimi-supervisor-front@.service: the units "
        "install-unit writes",
    ),
)
SEE_ALSO = (
    ("kimi-supervisor.toml", 5),
    ("systemctl", 1),
    ("journalctl", 1),
    ("systemd.service", 5),
    ("systemd.exec", 5),
)


def _roff(text: str) -> str:
    """One paragraph of plain text as roff: backslashes and hyphens escaped, no line starting a request."""
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.splitlines())


def _see_also() -> str:
    return ",\n".join(f".BR {_roff(name)} ({section})" for name, section in SEE_ALSO)


def _tagged(items: list[tuple[str, str]] | tuple[tuple[str, str], ...], tag: str = ".B") -> str:
    return "\n".join(f".TP\n{tag} {_roff(head)}\n{_roff(body)}" for head, body in items)


def _manpage() -> str:
    """kimi-supervisor(1): the parser's page, its exit codes under EXIT STATUS (was: a COMMENTS blob), EXAMPLES,
    FILES and SEE ALSO."""
    from argparse_manpage.manpage import Manpage

    parser = whole_parser()
    parser.epilog = None  # --help's exit codes and examples: sections of their own here
    page = Manpage(parser, _data=MAN_DATA)
    page.add_section("exit status", "=", _tagged([(str(int(c)), DESCRIPTIONS[c]) for c in sorted(DESCRIPTIONS)]))
    page.add_section("examples", "=", _tagged(list(EXAMPLES)))
    page.add_section("files", "=", _tagged(FILES, ".I"))
    page.add_section("see also", "=", _see_also())
    # The .TH line's date is the day it was generated (SOURCE_DATE_EPOCH when set); --check ignores it.
    text = str(page)
    return text if text.endswith("\n") else text + "\n"


_KEY_ROW = re.compile(r"^\| `([a-z_.]+)` \| (.*?) \| (.*) \|$")


def _plain(markdown: str) -> str:
    """Markdown's inline marks dropped (code spans, bold, links' targets): what a man page shows as text."""
    text = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown)
    return text.replace("**", "").replace("`", "")


def _config_page() -> str:
    """kimi-supervisor.toml(5): every key of docs/configuration.md's tables, with its default and meaning."""
    from argparse_manpage.manpage import Manpage

    doc = CONFIGURATION.read_text()
    rows = [m.groups() for m in map(_KEY_ROW.match, doc.splitlines()) if m]
    intro = next(p for p in doc.split("\n\n") if p.startswith("One TOML file"))
    date = Manpage(whole_parser(), _data=MAN_DATA).date  # as kimi-supervisor(1)'s
    keys = "\n".join(
        f".TP\n.B {_roff(key)}\n{_roff(f'default: {_plain(default)}. {_plain(meaning)}')}"
        for key, default, meaning in rows
    )
    return (
        f'.TH KIMI\\-SUPERVISOR.TOML "5" "{_roff(date)}" "kimi\\-supervisor" "kimi\\-supervisor manual"\n'
        ".SH NAME\nkimi\\-supervisor.toml \\- the configuration file of kimi\\-supervisor(1)\n"
        ".SH SYNOPSIS\n/etc/kimi\\-supervisor/kimi\\-supervisor.toml, /etc/kimi\\-supervisor/NAME.toml,\n"
        "NAME.weights.toml, NAME.front.toml\n"
        f".SH DESCRIPTION\n{_roff(' '.join(_plain(intro).split()))}\n"
        f".SH KEYS\n{keys}\n"
        ".SH SEE ALSO\n.BR kimi\\-supervisor (1);\n"
        "docs/configuration.md beside the README the install put under share/doc/kimi\\-supervisor/\n"
    )


def render(kind: str) -> str:
    parser = whole_parser()
    if kind == "man":
        return _manpage()
    if kind == "man5":
        return _config_page()
    import shtab

    return shtab.complete(parser, shell=kind, preamble=PREAMBLE[kind])


def _body(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(".TH "))


def main(argv: list[str]) -> int:
    stale = []
    for kind, path in OUTPUTS.items():
        text = render(kind)
        if "--check" in argv:
            if not path.is_file() or _body(path.read_text()) != _body(text):
                stale.append(str(path.relative_to(HERE.parent)))
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run python3 packaging/generate_shell_files.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
