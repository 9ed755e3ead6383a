"""Write the shell completion and the man page from the argparse parser (cli/args.py: whole_parser).

    python3 packaging/generate_shell_files.py          # rewrite the files below
    python3 packaging/generate_shell_files.py --check  # exit 1 when one is out of date (tests/cli/test_shell_files.py)

shtab and argparse-manpage are build-time tools (the dev extra), not runtime dependencies: the generated files
are committed and installed as data files (pyproject's [tool.setuptools.data-files]), so a host needs neither.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kimi_supervisor.cli.args import COMPLETE_DEPLOYMENTS, whole_parser  # noqa: E402

OUTPUTS = {
    # Named as bash-completion and zsh look them up (by the command's name), installed as they are.
    "bash": HERE / "completion" / "bash" / "kimi-supervisor",
    "zsh": HERE / "completion" / "zsh" / "_kimi-supervisor",
    "man": HERE / "man" / "kimi-supervisor.1",
}

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


def render(kind: str) -> str:
    parser = whole_parser()
    if kind == "man":
        from argparse_manpage.manpage import Manpage

        # The .TH line's date is the day it was generated (SOURCE_DATE_EPOCH when set); --check ignores it.
        page = str(Manpage(parser, _data=MAN_DATA))
        return page if page.endswith("\n") else page + "\n"
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
