"""Comments and docstrings name files that exist: a name ending in `.py` in a comment or docstring of
kimi_supervisor/, testkit/, bench/, gpuaccept/ or tests/ is a file of this tree, unless it is another project's.

The rule (beside tests/test_layers.py, which checks the imports of the same tree):
- A path with folders (`config/load.py`, `tests/nspawn/checkout.py`): when its first folder is a folder of
  this repository (kimi_supervisor, config, lifecycle, fakes, ...), some file of the tree ends with that path.
  A path whose first folder is none of ours (`vllm/engine/arg_utils.py`, `v1/worker/utils.py`,
  `weight_cache/protocol.py`) names vLLM's tree, or another project's, and is left alone.
- A bare name (`spawnplan.py`): some file of the tree has that name, or FOREIGN lists it with the file of
  the other project it stands for.  A new reference to vLLM's source says `vllm/...`, or goes into FOREIGN.
- An absolute path (`/usr/lib/...`) is a host's, never checked.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("kimi_supervisor", "testkit", "bench", "gpuaccept", "tests")
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}

# Bare names of other projects' files that comments here cite (mostly with a line number), and where they live.
FOREIGN = {
    "compiler_interface.py": "vllm/compilation/compiler_interface.py",
    "daemon.py": "vllm/model_executor/model_loader/weight_cache/daemon.py",
    "default_loader.py": "vllm/model_executor/model_loader/default_loader.py",
    "envs.py": "vllm/envs.py",
    "eval.py": "an evaluation script of the operator's, in an example command",
    "gpu_worker.py": "vllm/v1/worker/gpu_worker.py",
    "h11_impl.py": "uvicorn/protocols/http/h11_impl.py",
    "ipc_loader.py": "vllm/model_executor/model_loader/weight_cache/ipc_loader.py",
    "loggers.py": "vllm/v1/metrics/loggers.py",
    "multiproc_executor.py": "vllm/v1/executor/multiproc_executor.py",
    "preload.py": "vllm/entrypoints/cli/preload.py",
    "protocol.py": "vllm/model_executor/model_loader/weight_cache/protocol.py",
    "serve.py": "vllm/entrypoints/cli/serve.py",
    "serving.py": "vllm/entrypoints/openai/ (its serving.py modules)",
    "utils.py": "vllm/model_executor/model_loader/weight_cache/utils.py",
    "weight_utils.py": "vllm/model_executor/model_loader/weight_utils.py",
}

# A file name ending in .py, with the folders before it; never the tail of an absolute path or of a longer word.
MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Za-z_][\w-]*\.py)(?!\w)")


class Tree:
    """The repository's files and folder names, as the rule needs them."""

    def __init__(self, root: Path = REPO) -> None:
        self.files: set[str] = set()
        self.names: set[str] = set()
        self.folders: set[str] = set()
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and "egg-info" not in d]
            self.folders.update(dirs)
            rel = Path(dirpath).relative_to(root)
            for name in files:
                self.files.add((rel / name).as_posix())
                self.names.add(name)

    def problem(self, mention: str) -> str | None:
        """Why `mention` names no file of this tree, or None when it is fine by the rule."""
        if "/" not in mention:
            if mention in self.names or mention in FOREIGN:
                return None
            return "no file of this tree has that name (another project's file: add it to FOREIGN)"
        first = mention.split("/", 1)[0]
        if first not in self.folders:
            return None  # another project's tree
        if any(f == mention or f.endswith("/" + mention) for f in self.files):
            return None
        return "no file of this tree ends with that path"


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring in `path`."""
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def bad_mentions(path: Path, tree: Tree, shown_as: str) -> list[str]:
    found = []
    for line, text in prose(path):
        for match in MENTION.finditer(text):
            why = tree.problem(match.group(1))
            if why is not None:
                found.append(f"{shown_as}:{line}: {match.group(1)}: {why}")
    return found


def test_comments_and_docstrings_name_files_that_exist() -> None:
    tree = Tree()
    found = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            found += bad_mentions(path, tree, path.relative_to(REPO).as_posix())
    assert found == []


def test_the_check_fails_on_a_comment_naming_a_module_that_is_gone(tmp_path: Path) -> None:
    gone_flat = "spawn" + "user.py"  # split, so that this file's own prose stays clean
    gone_path = "lifecycle/" + "liveness.py"
    planted = tmp_path / "planted.py"
    planted.write_text(
        f'"""Built by config/load.py from the TOML file; the old {gone_path} is gone."""\n'
        "\n"
        f"X = 1  # resolved when the child is spawned ({gone_flat})\n"
        "# vLLM's side: vllm/engine/arg_utils.py, v1/worker/utils.py:716, protocol.py:42 SOCKET_NAME_TEMPLATE\n"
        "# the harness: tests/nspawn/checkout.py, /usr/lib/python3/dist-packages/whatever_host_file.py\n"
    )
    assert bad_mentions(planted, Tree(), "planted.py") == [
        f"planted.py:3: {gone_flat}: no file of this tree has that name (another project's file: add it to FOREIGN)",
        f"planted.py:1: {gone_path}: no file of this tree ends with that path",
    ]


def test_the_rule_reads_folders_and_names_from_the_tree(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("")
    tree = Tree(tmp_path)
    assert tree.problem("mod.py") is None and tree.problem("sub/mod.py") is None
    assert tree.problem("pkg/sub/mod.py") is None
    assert tree.problem("pkg/other.py") is not None and tree.problem("other.py") is not None
    assert tree.problem("vllm/other.py") is None  # not a folder of this tree: another project's
