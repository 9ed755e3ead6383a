"""Deployment checks: can `vllm serve` start here at all?

Each check is a small pure-ish function returning a `Check`; the preflight
collects them into the report an operator reads in five seconds.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import psutil

from kimi_supervisor.checks import Check, Verdict
from kimi_supervisor.config.vllm_args import VllmArgs
from kimi_supervisor.host import pagecache
from kimi_supervisor.host.gpu import GpuMemory


def check_gpu_count(visible: int, selected: tuple[int, ...], tp: int, world: int = 0, flags: str = "") -> Check:
    """`world`: TP x PP x DP, the GPUs one node's vLLM takes (0: TP alone); `flags` names them for the message."""
    world = world or tp
    flags = flags or f"--tensor-parallel-size {tp}"
    data: dict[str, object] = {"visible": visible, "selected": list(selected), "tensor_parallel_size": tp}
    missing = [i for i in selected if i >= visible]
    if missing:
        return Check(
            "gpus",
            Verdict.FAIL,
            f"configured GPU(s) {missing} do not exist: NVML sees {visible} GPU(s)",
            {"visible": visible, "selected": list(selected)},
        )
    if len(selected) < world:
        return Check(
            "gpus",
            Verdict.FAIL,
            f"{flags} needs {world} GPUs but only {len(selected)} are available "
            f"(NVML sees {visible}, preflight.gpus selects {list(selected)})",
            data | {"world_size": world},
        )
    what = f"tensor-parallel size {tp}" if world == tp else f"world size {world} ({flags})"
    return Check(
        "gpus", Verdict.OK, f"{len(selected)} GPU(s) {list(selected)} for {what}", data | {"world_size": world}
    )


def check_free_memory(memory: list[GpuMemory], utilization: float, releasable_mib: Mapping[int, int]) -> Check:
    """vLLM refuses to start unless free >= utilization x total on every GPU."""
    short = []
    rows = []
    for m in memory:
        need = int(utilization * m.total_mib)
        free = m.free_mib + releasable_mib.get(m.index, 0)
        rows.append({"gpu": m.index, "free_mib": m.free_mib, "need_mib": need, "total_mib": m.total_mib})
        if free < need:
            short.append(f"GPU {m.index}: {free} MiB free < {need} MiB ({utilization:g} x {m.total_mib} MiB)")
    if short:
        return Check(
            "gpu_memory_fraction",
            Verdict.FAIL,
            "--gpu-memory-utilization cannot be met (vLLM would fail with 'Free memory on device "
            "... is less than desired GPU memory utilization'): " + "; ".join(short),
            {"gpus": rows},
        )
    projected = " after reaping" if any(releasable_mib.values()) else ""
    return Check(
        "gpu_memory_fraction", Verdict.OK, f"every GPU has >= {utilization:g} x total free{projected}", {"gpus": rows}
    )


def vllm_config(vllm: VllmArgs) -> Check:
    """vLLM's own `--config FILE`: what the supervisor took from it and argv together (config/vllm_yaml.py
    read it as vLLM does; what it could not read was a config error before any check)."""
    return Check(
        "vllm-config",
        Verdict.OK,
        f"{vllm.config_file} read as vLLM reads it: model {vllm.model}, serving {vllm.host}:{vllm.port}, "
        f"{vllm.parallel_flags}",
        {"path": vllm.config_file or "", "model": vllm.model or "", "port": vllm.port},
    )


def check_model(model: str | None) -> Check:
    if model is None:
        return Check("model", Verdict.FAIL, "no model in child.argv (expected `vllm serve MODEL` or --model MODEL)")
    path = Path(model)
    if not path.is_absolute() and not model.startswith(".") and not path.exists():
        return Check("model", Verdict.SKIP, f"{model!r} is not a local path (a hub id?): not checked offline")
    if not path.is_dir():
        return Check("model", Verdict.FAIL, f"model directory {model} does not exist or is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        return Check("model", Verdict.FAIL, f"model directory {model} is not readable by uid {os.geteuid()}")
    # The shards must resolve inside the model (pagecache.boundary): a link to any other file is refused
    # unread, and a bad index is this failed check, never an exception (docs/fault-matrix.md).
    bound = pagecache.boundary(path)
    index = path / pagecache.INDEX
    try:
        names = pagecache.index_names(path)
    except pagecache.ModelFileError as exc:
        return Check("model", Verdict.FAIL, f"{index}: unreadable shard index ({exc.what})")
    if names is None:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            return Check("model", Verdict.FAIL, f"{model} holds no *.safetensors file and no index")
        outside = [p.name for p in shards if not pagecache.inside(p, bound)]
        if outside:
            return _outside(outside, len(shards), f"of the *.safetensors in {model}", bound)
        return Check("model", Verdict.OK, f"{len(shards)} safetensors file(s) in {model}", {"shards": len(shards)})
    shard_names = sorted(names)
    outside = [n for n in shard_names if not pagecache.inside(path / n, bound)]
    if outside:
        return _outside(outside, len(shard_names), f"named in {index}", bound)
    missing = []
    size = 0
    for name in shard_names:
        try:
            size += (path / name).stat().st_size
        except OSError:
            missing.append(name)
    if missing:
        return Check(
            "model",
            Verdict.FAIL,
            f"{len(missing)} of {len(shard_names)} shards named in {index.name} are missing: {_some(missing)}",
            {"shards": len(shard_names), "missing": missing},
        )
    return Check(
        "model",
        Verdict.OK,
        f"all {len(shard_names)} shards present ({size / 1e9:.1f} GB) in {model}",
        {"shards": len(shard_names), "bytes": size},
    )


def _some(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _outside(names: list[str], total: int, which: str, bound: Path) -> Check:
    return Check(
        "model",
        Verdict.FAIL,
        f"{len(names)} of {total} shards {which} resolve outside the model ({bound}): {_some(names)}",
        {"shards": total, "outside": names},
    )


def check_port(host: str, port: int) -> Check:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host or "0.0.0.0"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # vLLM binds with SO_REUSEADDR too: TIME_WAIT leftovers are no conflict.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                pid, who = listener(port)
                return Check(
                    "port",
                    Verdict.FAIL,
                    f"port {port} on {bind_host} is already in use{who}",
                    {"host": bind_host, "port": port, "pid": pid},
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return Check(
                    "port",
                    Verdict.FAIL,
                    f"--host {bind_host} is not an address of this machine",
                    {"host": bind_host, "port": port},
                )
            return Check(
                "port",
                Verdict.FAIL,
                f"cannot bind {bind_host}:{port}: {exc.strerror}",
                {"host": bind_host, "port": port},
            )
    return Check("port", Verdict.OK, f"{bind_host}:{port} is free", {"host": bind_host, "port": port})


def listener(port: int) -> tuple[int | None, str]:
    """The PID listening on `port`, when the kernel tells us (root sees all)."""
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    return conn.pid, f" by PID {conn.pid} ({psutil.Process(conn.pid).name()})"
                except psutil.Error:
                    return conn.pid, f" by PID {conn.pid}"
    except (psutil.AccessDenied, OSError):
        pass
    return None, ""


def check_local_gpus(visible: int, selected: tuple[int, ...], local_world_size: int, nnodes: int) -> Check:
    """A group node needs its share of the world, not the whole TP size (TP=16 over two hosts: 8 each)."""
    data = {"visible": visible, "selected": list(selected), "local_world_size": local_world_size}
    missing = [i for i in selected if i >= visible]
    if missing:
        return Check("gpus", Verdict.FAIL, f"configured GPU(s) {missing} do not exist: NVML sees {visible}", data)
    if len(selected) < local_world_size:
        return Check(
            "gpus",
            Verdict.FAIL,
            f"this node's share of the group needs {local_world_size} GPUs (world / {nnodes} nodes), "
            f"only {len(selected)} are available",
            data,
        )
    return Check("gpus", Verdict.OK, f"{len(selected)} GPU(s) for this node's share of {local_world_size}", data)
