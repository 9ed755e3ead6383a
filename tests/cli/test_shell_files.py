"""The shell completion and the man page (packaging/completion/, packaging/man/) name every command and option the
parser has, are what packaging/generate_shell_files.py writes from it today, and are installed by the package."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.cli.args import COMMANDS, _command_parser

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
BASH = REPO / "packaging" / "completion" / "bash" / "kimi-supervisor"
ZSH = REPO / "packaging" / "completion" / "zsh" / "_kimi-supervisor"
MAN = REPO / "packaging" / "man" / "kimi-supervisor.1"
MAN5 = REPO / "packaging" / "man" / "kimi-supervisor.toml.5"


def options(command: str) -> set[str]:
    return {opt for action in _command_parser(command)._actions for opt in action.option_strings}


def complete(*words: str) -> set[str]:
    """What bash offers after `kimi-supervisor WORDS...` (the last word the one being completed)."""
    script = (
        f"source {BASH}; COMP_WORDS=(kimi-supervisor {' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words)}; _shtab_kimi_supervisor; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True)
    return set(done.stdout.split())


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completes_every_command_and_every_option_of_each() -> None:
    assert complete("") == set(COMMANDS)
    for command in COMMANDS:
        assert complete(command, "--") == {o for o in options(command) if o.startswith("--")}, command
    # No command word: `run`'s options, as the parser takes them.
    assert complete("--") == {o for o in options("run") if o.startswith("--")}


def test_zsh_and_the_man_page_name_every_command_and_option() -> None:
    zsh, man = ZSH.read_text(), MAN.read_text().replace("\\-", "-")
    assert zsh.startswith("#compdef kimi-supervisor\n")
    for command in COMMANDS:
        assert re.search(rf"\b{command}\b", zsh) and f"COMMAND 'kimi-supervisor {command}'" in man.replace(
            "\\fI\\,", ""
        ).replace("\\/\\fR", ""), command
        for opt in options(command):
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", zsh), (command, opt)
            assert opt in man or opt in ("-h", "--help"), (command, opt)  # the page is the help


@pytest.mark.skipif(
    importlib.util.find_spec("shtab") is None or importlib.util.find_spec("argparse_manpage") is None,
    reason="the dev extra's shtab and argparse-manpage are not installed",
)
def test_the_committed_files_are_what_the_parser_generates_today() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "packaging" / "generate_shell_files.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_package_installs_them_where_bash_zsh_and_man_look() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert data == {
        "share/bash-completion/completions": [str(BASH.relative_to(REPO))],
        "share/zsh/site-functions": [str(ZSH.relative_to(REPO))],
        "share/man/man1": [str(MAN.relative_to(REPO))],
        "share/man/man5": [str(MAN5.relative_to(REPO))],
        "lib/systemd/catalog": ["packaging/journal/kimi-supervisor.catalog"],  # tests/logs/test_catalog.py
        # What Documentation= and runbook_url name: tests/systemd/test_install_venv.py
        "share/doc/kimi-supervisor": ["README.md"],
        "share/doc/kimi-supervisor/docs": ["docs/*.md"],
        # Every folder of docs/ too: the fault matrix's areas, the history its reference pages link to.
        **{
            f"share/doc/kimi-supervisor/docs/{d.name}": [f"docs/{d.name}/*.md"]
            for d in sorted((REPO / "docs").iterdir())
            if d.is_dir() and any(d.glob("*.md"))
        },
    }


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completes_status_with_the_deployments_names(tmp_path: Path) -> None:
    """`kimi-supervisor status <Tab>`: each deployment configured (its engine's, holder's and front's files name it
    once) and each with a state file under the runtime directory (was: nothing offered)."""
    etc, run = tmp_path / "etc", tmp_path / "run"
    for config in ("kimi-a.toml", "kimi-a.front.toml", "kimi-b.weights.toml", "other.toml"):
        (etc / config).parent.mkdir(exist_ok=True)
        (etc / config).write_text("")
    (run / "kimi-c").mkdir(parents=True)
    (run / "kimi-c" / "state.json").write_text("{}")
    (run / "not-one").mkdir()  # a directory without a state file is no deployment
    script = (
        f"source {BASH}; COMP_WORDS=(kimi-supervisor status ki); COMP_CWORD=2; _shtab_kimi_supervisor; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    env = {"PATH": "/usr/bin:/bin", "KIMI_SUPERVISOR_CONFIG_DIR": str(etc), "KIMI_SUPERVISOR_RUNTIME_DIR": str(run)}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, check=True, env=env)
    assert sorted(done.stdout.split()) == ["kimi-a", "kimi-b", "kimi-c"]


# Where journald reads catalogs (systemd 252 catalog.c: catalog_file_dirs); a venv's lib/systemd/catalog is not one.
JOURNALD_CATALOG_DIRS = ("/usr/local/lib/systemd/catalog", "/usr/lib/systemd/catalog")


def test_the_docs_venv_recipes_reach_man_and_journald() -> None:
    """The README's venv install puts the man page and the catalog where neither man nor journald looks: the docs
    say how, truly (was: `MANPATH=VENV/share/man`, which hides every system page, and `journalctl --update-catalog`
    alone, which never reads the venv's catalog)."""
    text = "".join((REPO / "docs" / page).read_text() for page in ("configuration.md", "operators-view.md"))
    manpaths = re.findall(r"MANPATH=([^\s`]+)", text)
    assert manpaths and all(m.endswith(":") for m in manpaths), manpaths
    targets = re.findall(r"install -D -m 0644 -t (\S+) \S+/kimi-supervisor\.catalog", text)
    assert targets and all(t.rstrip("/") in JOURNALD_CATALOG_DIRS for t in targets), targets
    assert "journalctl --update-catalog" in text


def test_the_man_page_has_exit_status_files_and_see_also_and_the_config_file_a_page_of_its_own() -> None:
    """man-pages(7)'s sections: the exit codes under EXIT STATUS (was: in a COMMENTS blob), FILES, SEE ALSO naming
    kimi-supervisor.toml(5), whose page has every key docs/configuration.md documents."""
    from kimi_supervisor.exitcodes import DESCRIPTIONS

    page = MAN.read_text()
    sections = re.findall(r"^\.SH (.+)$", page, re.M)
    assert "COMMENTS" not in sections
    assert sections[-4:] == ["EXIT STATUS", "EXAMPLES", "FILES", "SEE ALSO"]
    exit_status = page.split(".SH EXIT STATUS\n")[1].split(".SH ")[0]
    assert re.findall(r"^\.B (\d+)$", exit_status, re.M) == [str(int(c)) for c in sorted(DESCRIPTIONS)]
    assert ".BR kimi\\-supervisor.toml (5)" in page.split(".SH SEE ALSO\n")[1]
    config_page = MAN5.read_text()
    assert config_page.startswith('.TH KIMI\\-SUPERVISOR.TOML "5" ')
    documented = re.findall(r"^\| `([a-z_.]+)` \|", (REPO / "docs" / "configuration.md").read_text(), re.M)
    keys = [k.replace("\\-", "-") for k in re.findall(r"^\.TP\n\.B (\S+)$", config_page, re.M)]
    assert keys == documented and len(keys) > 50
