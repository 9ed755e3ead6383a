"""What the weight-holder stand-ins (docs/weight-holder.md) share: the weights folder, the handle messages on the Unix
socket, the checksum, the disk reader, and the restart-time arithmetic of the bench.

Pure Python here; torch is imported only inside the functions that touch the GPU, so the CPU tests import this
module (the CI has no torch) and the stand-ins' parents stay stdlib-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
# One read, one host-to-device copy: large enough that the syscall and launch cost vanish, small enough that
# the pinned buffer is cheap.  A multiple of 4096, so O_DIRECT accepts every read of a GiB-sized file.
CHUNK = 256 << 20
WEIGHTS_FILE = "weights.bin"
META_FILE = "weights.json"
# The READY line of vLLM 0.32's preload.py:321, which the supervisor's weights role waits for.
READY_LINE = "===== Weight cache daemon READY: node 0/1 serving {n} local rank(s) x 1 role(s) in {dir} ====="
_LEN = struct.Struct("!Q")


def gpu_uuid(rank: int) -> str:
    """The GPU's uuid as vLLM names it (NVML's `GPU-...`; current_platform.get_device_uuid)."""
    if fake():
        return f"GPU-fake-{rank}"
    import torch

    return f"GPU-{torch.cuda.get_device_properties(rank).uuid}"


def rank_socket(socket_dir: str | Path, rank: int) -> str:
    """vLLM's socket for GPU `rank` (weight_cache/protocol.py:42, 135-151: md5 of the GPU's uuid)."""
    digest = hashlib.md5(gpu_uuid(rank).encode()).hexdigest()
    return os.path.join(str(socket_dir), f"vllm_weight_cache_{digest}.sock")


def add_checksum(total: int, part: int) -> int:
    """The checksum is the sum of the bytes read as little-endian int32, modulo 2**64: chunks add in any order,
    and torch's int64 sum wraps the same way, so the GPU's sum of a whole tensor equals the writer's."""
    return (total + part) % (1 << 64)


def int32_sum(data: bytes) -> int:
    """The checksum of DATA (a multiple of 4 bytes) in pure Python: the reference for the torch sum."""
    count = len(data) // 4
    values: tuple[int, ...] = struct.unpack(f"<{count}i", data[: count * 4])
    return sum(values) % (1 << 64)


def write_meta(model: Path, nbytes: int, checksum: int) -> None:
    (model / META_FILE).write_text(json.dumps({"bytes": nbytes, "checksum": checksum}))


def read_meta(model: str | Path) -> dict[str, int]:
    meta: dict[str, int] = json.loads((Path(model) / META_FILE).read_text())
    return meta


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _LEN.size)
    (size,) = _LEN.unpack(head)
    # The peer is this deployment's own holder on a socket in a 0700 directory: unpickling its handles is what
    # vLLM's ipc_cache loader does too (weight_cache/protocol.py).
    return pickle.loads(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        part = sock.recv(size - len(buf))
        if not part:
            raise ConnectionError(f"the peer closed after {len(buf)} of {size} bytes")
        buf += part
    return bytes(buf)


def connect(path: str, deadline_s: float) -> socket.socket:
    """Connect to the holder's socket PATH, retrying while it is not there yet, for at most DEADLINE_S."""
    end = time.monotonic() + deadline_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() >= end:
                raise
            time.sleep(0.05)


@dataclass
class LoadResult:
    nbytes: int
    checksum: int
    seconds: float
    direct: bool  # O_DIRECT: every byte came from the device, none from the page cache


def fake() -> bool:
    """WEIGHTS_FAKE=1: no torch, no GPU; the "tensor" is the file's bytes (the CPU run of the orchestration)."""
    return os.environ.get("WEIGHTS_FAKE") == "1"


def load_to_gpu(path: str | Path, gpu: int) -> tuple[Any, LoadResult]:
    """Read the file at PATH into one uint8 tensor on GPU (real bytes, O_DIRECT where the filesystem allows it,
    through a pinned host buffer) and sum it there: (tensor, result)."""
    if fake():
        t0 = time.monotonic()
        data = Path(path).read_bytes()
        return data, LoadResult(len(data), int32_sum(data), time.monotonic() - t0, False)
    import torch

    torch.cuda.set_device(gpu)
    t0 = time.monotonic()
    size = os.path.getsize(path)
    out = torch.empty(size, dtype=torch.uint8, device=f"cuda:{gpu}")
    pinned = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
    view = memoryview(pinned.numpy())
    direct = True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < size:
            want = min(CHUNK, size - off)
            try:
                got = os.preadv(fd, [view[:want]], off)
            except OSError:  # O_DIRECT refused at the first read (alignment, filesystem): read buffered
                if not direct or off:
                    raise
                os.close(fd)
                fd, direct = os.open(path, os.O_RDONLY), False
                continue
            if got <= 0:
                raise OSError(f"{path}: short read at {off} of {size}")
            out[off : off + got].copy_(pinned[:got])
            off += got
    finally:
        os.close(fd)
    checksum = gpu_checksum(out)
    return out, LoadResult(size, checksum, time.monotonic() - t0, direct)


def gpu_checksum(tensor: Any) -> int:
    """add_checksum's sum of a uint8 CUDA tensor, computed on its GPU (of bytes, in Python: WEIGHTS_FAKE), in
    CHUNK-sized slices: one int64 cast of the whole would take twice the tensor's size again (the H200 run of
    2026-12-02 held 24 GiB of such a temporary beside 12 GiB of weights), and the cache is emptied after."""
    if isinstance(tensor, bytes):
        return int32_sum(tensor)
    import torch

    flat = tensor.view(torch.int32)
    step = CHUNK // 4
    total = 0
    for off in range(0, int(flat.numel()), step):
        total = add_checksum(total, int(flat[off : off + step].sum(dtype=torch.int64).item()))
    torch.cuda.empty_cache()
    return total


def supervisor_share(crash: float, spawn: float, health_200: float, ready: float) -> dict[str, float]:
    """Split one crash restart (monotonic seconds, one clock for every process of the machine): the supervisor's
    own share is crash -> the new child's first instruction plus the child's first /health 200 -> READY=1; the
    rest (spawn -> /health 200) is the engine's, here its torch start and the weights' load or mapping."""
    before, after = spawn - crash, ready - health_200
    if before < 0 or after < 0 or health_200 < spawn:
        raise ValueError(f"times out of order: crash {crash}, spawn {spawn}, health {health_200}, ready {ready}")
    return {
        "crash_to_spawn_s": before,
        "health_to_ready_s": after,
        "supervisor_share_s": before + after,
        "engine_s": health_200 - spawn,
        "crash_to_ready_s": ready - crash,
    }


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def scene_report(out: Path, name: str, title: str, res: dict[str, Any], checks: list[tuple[str, bool, str]]) -> int:
    """A scene's checks into OUT/NAME.json (with `res`) and OUT/NAME.md, the table printed; 0 when all passed."""
    res["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    table = md_table(["check", "result", "detail"], [[n, "PASS" if ok else "FAIL", d[:300]] for n, ok, d in checks])
    (out / f"{name}.md").write_text(f"# {title}, {res['date_utc']}\n\n{table}\n")
    print(table, flush=True)
    return 0 if all(ok for _, ok, _ in checks) else 1


def dry_run(config: Path) -> subprocess.CompletedProcess[str]:
    """The supervisor's `--dry-run` of one scene config, from the repository's checkout."""
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor", "--config", str(config), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=120,
        # Keep what the caller's PYTHONPATH adds (the device machine's carried wheels: structlog).
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))},
    )
