"""Which GPUs the child sees: `CUDA_VISIBLE_DEVICES` from `preflight.gpus`, numbered as NVML numbers them.

The supervisor frees, locks and watches the GPUs `preflight.gpus` names by NVML index; without this the child's
vLLM would take CUDA's devices 0..N-1, whichever deployment owns them (docs/configuration.md).  CUDA numbers devices
fastest-first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`; NVML numbers them by PCI bus id, so with that order an
index means the same device to both.

NVML indices, not GPU UUIDs: vLLM 0.32 would take UUIDs (vllm/platforms/cuda.py:751-756 maps a non-integer
entry through nvmlDeviceGetHandleByUUID), but the indices are what the config, the locks, the dry run and
`nvidia-smi -i` name, and they need no NVML call to be written (check-config runs without a driver).
"""

from __future__ import annotations

from collections.abc import Mapping

VISIBLE = "CUDA_VISIBLE_DEVICES"
ORDER = "CUDA_DEVICE_ORDER"
PCI_BUS_ID = "PCI_BUS_ID"


class PinningError(ValueError):
    """child.env disagrees with preflight.gpus; `key` is the child.env key, the message says both."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def visible_devices(gpus: tuple[int, ...]) -> str:
    return ",".join(str(g) for g in gpus)


def _indices(value: str) -> list[int] | None:
    parts = [p.strip() for p in value.split(",")]
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


def pinned_env(env: Mapping[str, str], gpus: tuple[int, ...] | None) -> dict[str, str]:
    """child.env with the GPU pinning added: every index of `gpus`, in PCI bus order.

    None ("all"): only the order here; the indices need NVML and are added at start (`pin_every_gpu`).
    (): a CPU deployment; its environment is left as configured.  PinningError when child.env pins others."""
    out = dict(env)
    if gpus == ():
        return out
    order = env.get(ORDER)
    if order is not None and order != PCI_BUS_ID:
        raise PinningError(
            ORDER,
            f"{order!r}: CUDA would number the GPUs otherwise than the NVML indices preflight.gpus names; "
            f"remove it (the supervisor sets {PCI_BUS_ID})",
        )
    given = env.get(VISIBLE)
    if given is not None:
        wanted = 'preflight.gpus = "all" (every GPU NVML sees)' if gpus is None else f"preflight.gpus = {list(gpus)}"
        indices = _indices(given)
        if gpus is None or indices is None or sorted(indices) != sorted(gpus):
            raise PinningError(
                VISIBLE,
                f"{given!r} pins other GPUs than {wanted}: remove it (the supervisor pins preflight.gpus) "
                "or set preflight.gpus to the same NVML indices",
            )
    out[ORDER] = PCI_BUS_ID
    if gpus is not None:
        out.setdefault(VISIBLE, visible_devices(gpus))
    return out


def pin_every_gpu(env: Mapping[str, str], count: int) -> dict[str, str]:
    """`gpus = "all"` at start: every GPU NVML sees now (count 0, NVML silent: left as is, the preflight fails)."""
    out = dict(env)
    if count > 0 and ORDER in out:  # ORDER: pinned_env ran, so this is not a CPU deployment
        out.setdefault(VISIBLE, visible_devices(tuple(range(count))))
    return out


# NCCL >= 2.24 runs a RAS thread in every process that joins a communicator, listening on localhost:28028 unless
# NCCL_RAS_ADDR says otherwise: two deployments on one host (or another user's job there) would share that
# endpoint.  Each gets its own port, derived from its lowest GPU: deployments on one host hold disjoint GPUs
# (the instance lock refuses overlaps), so no two derive the same one; a weight holder (its daemons form their
# own process group, weight_cache/daemon.py:282) takes the odd port beside its engine's.  A hot spare (docs/spare.md:
# a second engine's communicators on the same GPUs) takes one of a range of its own, above every pair's.
NCCL_RAS_ADDR = "NCCL_RAS_ADDR"
RAS_BASE_PORT = 28100
SPARE_RAS_BASE_PORT = RAS_BASE_PORT + 2 * 1024  # past the pairs of 1024 GPU indices (config/load.py's bound)
RAS_SLOTS = 3  # 0: the engine, 1: its weight holder, 2: its spare (config/role_spec.py ras_slot)


def ras_port_of(first_gpu: int, slot: int) -> int:
    """The NCCL RAS port of the supervisor in `slot` of the deployment whose lowest GPU is `first_gpu`."""
    return SPARE_RAS_BASE_PORT + first_gpu if slot == 2 else RAS_BASE_PORT + 2 * first_gpu + slot


def ras_env(env: Mapping[str, str], gpus: tuple[int, ...] | None, slot: int) -> dict[str, str]:
    """child.env with this deployment's NCCL_RAS_ADDR, unless child.env sets it or the deployment has no GPU."""
    out = dict(env)
    if gpus == ():
        return out
    if NCCL_RAS_ADDR in out:
        if ras_port(out) is None:
            raise PinningError(
                NCCL_RAS_ADDR, f"expected HOST:PORT (PORT 1..65535, as NCCL reads it), got {out[NCCL_RAS_ADDR]!r}"
            )
        return out
    first = min(gpus) if gpus else 0
    out[NCCL_RAS_ADDR] = f"127.0.0.1:{ras_port_of(first, slot)}"
    return out


def ras_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """child.env's NCCL_RAS_ADDR as (host, port): where the child's RAS service listens; None if unset."""
    host, sep, port = env.get(NCCL_RAS_ADDR, "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)  # "[::1]:28028": the brackets are the address's, not the host's


def ras_port(env: Mapping[str, str]) -> int | None:
    """The port of child.env's NCCL_RAS_ADDR (the supervisor locks it like its serving port), None if unset."""
    address = ras_address(env)
    return address[1] if address else None
