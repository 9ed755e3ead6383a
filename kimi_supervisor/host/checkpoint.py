"""The checkpoint's share of vLLM's weight-cache key, computed as vLLM 0.32 computes it (docs/weight-holder.md).

`vllm/model_executor/model_loader/weight_cache/protocol.py` `hash_checkpoint`: each `*.safetensors` of the model
directory (those the index names, when there is one: weight_utils.py `filter_duplicate_safetensors_files`),
sorted by base name, hashed as name + the raw safetensors header (the 8-byte length and the JSON: tensor names,
dtypes, shapes, offsets), no weight bytes read.  md5 where the interpreter allows it, else sha256 (vLLM's
`safe_hash`).  The holder's supervisor records it as its child starts; the engine's supervisor compares its own
before it starts, so a model changed on disk under a live holder is named at once (the shards whose headers
differ) instead of as the daemon's key mismatch inside vLLM's load.

Headers only: a checkpoint rewritten with the same tensor layout and new bytes keeps its fingerprint, in vLLM
as here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from kimi_supervisor.host import pagecache

INDEX = pagecache.INDEX
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A shard or the index cannot be read as vLLM would read it (the text names the file)."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    digest: str  # vLLM's WeightCacheKey.checkpoint
    shards: dict[str, str]  # base name -> the digest of that shard's header alone: which shard changed

    def to_doc(self) -> dict[str, Any]:
        return {"digest": self.digest, "shards": dict(self.shards)}


def _hasher() -> Any:
    try:
        return hashlib.md5(usedforsecurity=False)
    except ValueError:  # FIPS: vLLM's safe_hash falls back the same way
        return hashlib.sha256()


def _regular(path: Path, within: Path) -> int:
    try:
        return pagecache.open_regular(path, within)
    except ValueError as exc:  # outside the model, a FIFO or a device: refused unopened
        raise CheckpointError(str(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None


def _header(path: Path, within: Path) -> bytes:
    # The errors name no number read from the file: what a shard's first bytes hold is never published.
    fd = _regular(path, within)
    with open(fd, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise CheckpointError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", size)
        if length > MAX_HEADER:
            raise CheckpointError(f"{path}: its first 8 bytes give a safetensors header of more than {MAX_HEADER}")
        body = f.read(length)
        if len(body) < length:
            raise CheckpointError(f"{path}: the safetensors header is cut short (the file ends inside it)")
    return size + body


def _indexed(model: Path, files: list[Path]) -> list[Path]:
    try:
        names = pagecache.index_names(model)
    except pagecache.ModelFileError as exc:
        raise CheckpointError(str(exc)) from None
    if names is None:
        return files
    named = {model / n for n in names}
    missing = sorted(p.name for p in named - set(files))
    if missing:
        raise CheckpointError(f"{model / INDEX} names shards that are missing: {', '.join(missing[:3])}")
    return [f for f in files if f in named]


def fingerprint(model: str | Path | None) -> Fingerprint | None:
    """vLLM's checkpoint fingerprint of MODEL, or None where vLLM falls back to the model's name (not a local
    directory, or no safetensors in it).  CheckpointError when a file cannot be read."""
    if model is None or not os.path.isdir(model):
        return None
    root = Path(model)
    files = sorted(root.glob("*.safetensors"))
    files = _indexed(root, files)
    if not files:
        return None
    whole = _hasher()
    shards: dict[str, str] = {}
    within = pagecache.boundary(root)
    for path in sorted(files, key=lambda p: p.name):
        header = _header(path, within)
        whole.update(path.name.encode())
        whole.update(header)
        one = _hasher()
        one.update(header)
        shards[path.name] = one.hexdigest()
    return Fingerprint(whole.hexdigest(), shards)


def changed_shards(held: dict[str, Any], now: Fingerprint, most: int = 3) -> str:
    """In words, what differs between the fingerprint a holder recorded (its doc) and NOW's."""
    before = held.get("shards") if isinstance(held.get("shards"), dict) else {}
    assert isinstance(before, dict)
    changed = sorted(n for n in set(before) & set(now.shards) if before[n] != now.shards[n])
    added = sorted(set(now.shards) - set(before))
    gone = sorted(set(before) - set(now.shards))
    parts = []
    for what, names in (("header changed", changed), ("new", added), ("gone", gone)):
        if names:
            more = f" and {len(names) - most} more" if len(names) > most else ""
            parts.append(f"{what}: {', '.join(names[:most])}{more}")
    return "; ".join(parts) or "the shards' headers are the same, their order or names differ"
