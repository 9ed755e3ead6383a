"""vLLM's model-info cache, copied into a test container before its first vLLM start.

Unless `$VLLM_CACHE_ROOT/modelinfos/` holds the answer for the model file's hash, vLLM 0.32 inspects the model
class in a Python of its own (vllm/model_executor/models/registry.py, `_LazyRegisteredModel.inspect_model_cls` and
`_run_in_subprocess`): one more interpreter importing torch, vLLM and the model, 8-16 s of CPU on 2 cores
(docs/history/test-suite-speed.md, "One vLLM start").  A host keeps that answer across restarts and reboots in the
unit's `CacheDirectory=`; a test container boots with an empty /var/cache, so its first start would pay for an
inspection that no real host repeats.  The copy is the host's own answer (root's vLLM cache, written by any local
vLLM start; where there is none yet, the container's start inspects, as vLLM does).  vLLM checks the hash it
stores, so a stale copy is a miss, never a wrong answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from kimi_supervisor.child.cachedirs import cache_home

if TYPE_CHECKING:
    from tests.nspawn.nspawn import NspawnMachine


def host_model_info() -> Path:
    """Where this host's vLLM keeps its model-info cache (vllm/envs.py: VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm,
    else ~/.cache/vllm)."""
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root:
        return Path(root) / "modelinfos"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "vllm" / "modelinfos"


# The shipped unit's CacheDirectory=kimi-supervisor, which is paths.cache_directory's default.
CACHE_DIRECTORY = Path("/var/cache/kimi-supervisor")


def seed_model_info(m: NspawnMachine) -> dict[str, str]:
    """Copy the host's model-info answers into the container's cache home for a child running as root (the child's
    `<dir>/uid-0`, 0700 as the supervisor makes it); each copy's path and inode (see `inodes`)."""
    home = cache_home(CACHE_DIRECTORY, None)
    assert home is not None and home.name == "uid-0", home  # the tests run as root, so does the unit's child
    src = host_model_info()
    paths = [str(home / "vllm" / "modelinfos" / f.name) for f in (sorted(src.glob("*.json")) if src.is_dir() else [])]
    for path in paths:
        m.write_file(path, (src / Path(path).name).read_text())
    if paths:
        m.run(["chmod", "0700", str(home)])
    return inodes(m, paths)


def inodes(m: NspawnMachine, paths: Iterable[str]) -> dict[str, str]:
    """Each path's inode in the container: a start that missed the cache inspects and writes its answer again
    through a new file renamed over the old (vLLM's atomic_writer), so a seeded file that kept its inode was read."""
    paths = list(paths)
    if not paths:
        return {}
    out = m.run(["stat", "-c", "%n %i", "--", *paths]).stdout
    return dict(line.rsplit(" ", 1) for line in out.splitlines())
