"""Real safetensors files for the tests (stdlib only): the format's 8-byte little-endian header length, the JSON
header (dtype, shape, data_offsets per tensor), then the bytes; and the index that names them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1}


def write_shard(path: Path, tensors: dict[str, tuple[str, list[int]]], fill: int = 0) -> Path:
    """One shard with TENSORS (name -> (dtype, shape)); every data byte is FILL."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = SIZES[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes([fill]) * offset)
    return path


def write_model(model: Path, shards: int = 3, hidden: int = 8) -> list[Path]:
    """A model directory of SHARDS shards, two tensors each, and its model.safetensors.index.json."""
    model.mkdir(parents=True, exist_ok=True)
    paths, weight_map = [], {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors = {f"layers.{i}.w": ("BF16", [hidden, hidden]), f"layers.{i}.b": ("F32", [hidden])}
        paths.append(write_shard(model / name, tensors))
        weight_map.update(dict.fromkeys(tensors, name))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return paths
