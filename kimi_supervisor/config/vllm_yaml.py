"""vLLM's own config file: `vllm serve [MODEL] --config kimi.yaml ...`, read as vLLM 0.32 reads it.

vLLM does not parse the YAML beside its argv: FlexibleArgumentParser turns it into argv words and inserts them
where command-line words override them (vllm/utils/argparse_utils.py, `_pull_args_from_config` and
`load_config_file`): each top-level key becomes `--KEY` (underscores become dashes, as on the command line),
`true` a bare flag, `false` its `--no-KEY` form or nothing, a list its items after one `--KEY`, a mapping one
JSON word, anything else `str(value)`; the words go right after `serve` (after the model when the command
line names it), so the command line's own words come later and win.  `expand` does the same, so the
supervisor's argv scanner (config/vllm_args.py) reads the port, host, model and sizes vLLM will use.

What vLLM would refuse or silently ignore, and what the supervisor reads only from argv, is a config error
naming the file and key: one line, exit 78, before the preflight kills anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from kimi_supervisor.config.vllm_args import option_name, parse_vllm_args

CONFIG_OPTION = "--config"
MAX_BYTES = 1 << 20  # a flag file; anything larger is not one
# Options the supervisor reads from child.argv's own words elsewhere: the canary sends --api-key
# (liveness/engine.py), so the key in the YAML alone would make every canary a 401; a nested `config`
# would be a second --config, which vLLM never reads.
ARGV_ONLY = {
    "api-key": "the canary reads it from child.argv: give it with child.credentials (VLLM_API_KEY) instead",
    "config": "vLLM reads one config file and never a --config inside it",
}
# The options config/vllm_args.py reads, which must be one scalar (served-model-name: one or more names).
_ONE_VALUE = frozenset(
    {
        "model",
        "host",
        "port",
        "tensor-parallel-size",
        "pipeline-parallel-size",
        "data-parallel-size",
        "gpu-memory-utilization",
        "shutdown-timeout",
    }
)
_NAMES = "served-model-name"


class VllmConfigError(ValueError):
    """child.argv's --config file cannot be read as vLLM reads it; the message names the file and the key."""


def config_path(argv: Sequence[str], working_directory: str | None) -> tuple[int, Path] | None:
    """Where `--config FILE` stands in argv and the file vLLM opens (relative to the child's working
    directory); None without one."""
    words = list(argv[1:])
    if any(w.startswith(CONFIG_OPTION + "=") for w in words):
        raise VllmConfigError(
            f"{CONFIG_OPTION}=FILE: vLLM 0.32 reads its config file only from two words, `{CONFIG_OPTION} FILE`; "
            "this form it accepts and ignores, so the file's flags would not apply"
        )
    count = words.count(CONFIG_OPTION)
    if count == 0:
        return None
    if count > 1:
        raise VllmConfigError(f"{CONFIG_OPTION} appears {count} times; vLLM refuses more than one config file")
    index = words.index(CONFIG_OPTION) + 1
    if index + 1 >= len(argv):
        raise VllmConfigError(f"{CONFIG_OPTION} has no value")
    raw = argv[index + 1]
    path = Path(raw)
    if not path.is_absolute():
        if working_directory is None:
            raise VllmConfigError(
                f"{CONFIG_OPTION} {raw}: a relative path is opened in vLLM's working directory: give an "
                "absolute path, or set child.working_directory"
            )
        path = Path(working_directory) / path
    if raw.split(".")[-1] not in ("yaml", "yml"):
        raise VllmConfigError(f"{CONFIG_OPTION} {raw}: vLLM reads only a .yaml or .yml file")
    return index, path


def _load(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: cannot read it: {exc.strerror}") from None
    if len(data) > MAX_BYTES:
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: larger than {MAX_BYTES} bytes, not a flag file")
    try:
        loaded = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        why = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: not YAML{line}: {why}") from None
    if not isinstance(loaded, dict):
        # vLLM calls .items() on it and dies with a traceback at start.
        got = "an empty file" if loaded is None else type(loaded).__name__
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: expected a mapping of vLLM options, got {got}")
    return loaded


def _words(path: Path, key: str, value: object) -> list[str]:
    """One key's argv words, as vLLM's load_config_file writes them."""
    option = option_name("--" + key)
    name = option[2:]
    if name in ARGV_ONLY:
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: {key}: {ARGV_ONLY[name]}")
    ours = name in _ONE_VALUE or name == _NAMES
    if ours and (value is None or isinstance(value, (bool, dict)) or (isinstance(value, list) and name != _NAMES)):
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: {key}: expected one value, got {value!r}")
    if name == _NAMES and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: {key}: expected names, got {value!r}")
    if isinstance(value, bool):
        # vLLM writes --no-KEY only where its parser has one; a false flag the supervisor never reads.
        return [option] if value else []
    if isinstance(value, list):
        if ours and not value:
            raise VllmConfigError(f"{CONFIG_OPTION} {path}: {key}: expected one or more names, got []")
        return [option, *(str(v) for v in value)] if value else []
    if isinstance(value, dict):
        return [option, json.dumps(value)]
    return [option, str(value)]


def config_words(path: Path) -> list[str]:
    """The file's argv words, in its order."""
    words: list[str] = []
    for key, value in _load(path).items():
        if not isinstance(key, str) or not key:
            raise VllmConfigError(f"{CONFIG_OPTION} {path}: key {key!r}: vLLM options are names")
        words += _words(path, key, value)
    return words


def expand(argv: Sequence[str], working_directory: str | None) -> tuple[tuple[str, ...], Path | None]:
    """argv as vLLM's parser sees it once it has read `--config FILE`, and that file (None: no --config)."""
    found = config_path(argv, working_directory)
    if found is None:
        return tuple(argv), None
    index, path = found
    inserted = config_words(path)
    try:
        # The file's own values, checked alone, so a bad one is named with the file it is in.
        parse_vllm_args([argv[0], *inserted])
    except ValueError as exc:
        raise VllmConfigError(f"{CONFIG_OPTION} {path}: {exc}") from None
    rest = [*argv[:index], *argv[index + 2 :]]
    if "serve" not in rest[1:]:
        # No subcommand (the api_server module): vLLM puts the file's words before all of its own.
        return (rest[0], *inserted, *rest[1:]), path
    at = rest.index("serve", 1) + 1
    positional = at < len(rest) and not rest[at].startswith("-")
    if positional:
        at += 1
    elif "--model" not in inserted and not any(re.match(r"^--model(=.+|$)", w) for w in rest):
        raise VllmConfigError(
            f"{CONFIG_OPTION} {path}: no model: neither child.argv (after `serve`) nor the file's `model` "
            "names one, and vLLM refuses to start without"
        )
    return (*rest[:at], *inserted, *rest[at:]), path
