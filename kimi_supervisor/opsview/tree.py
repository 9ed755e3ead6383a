"""Who is who in vLLM's process tree: API server, EngineCore, Worker_TPn, and their GPU memory.

vLLM names its processes with setproctitle (`VLLM::EngineCore`,
`VLLM::Worker_TP3`); the kernel keeps 15 bytes of that in comm
(`VLLM::Worker_TP`), so the rank is read from the command line, which carries
the full title.  The tree's root is the API server whatever it calls itself.
Only names and roles leave this module, never command lines: those may carry
`--api-key`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.host.proctable import ProcessTable

_WORKER = re.compile(r"VLLM::(Worker(?:_[A-Z]+\d+)*)")
_RANK = re.compile(r"_TP(\d+)")
_ENGINE = re.compile(r"VLLM::EngineCor(?:e(\w*))?")  # comm alone keeps "VLLM::EngineCor"
_API = re.compile(r"VLLM::(APIServer\w*)")

ROLE_ORDER = {"api_server": 0, "engine_core": 1, "worker": 2, "resource_tracker": 3, "other": 4}


@dataclasses.dataclass(frozen=True)
class TreeMember:
    pid: int
    ppid: int
    role: str  # api_server | engine_core | worker | resource_tracker | other
    label: str  # what an operator recognises: "API server", "EngineCore", "Worker_TP3"
    rank: int | None
    gpu_mib: tuple[tuple[int, int | None], ...] = ()  # (GPU index, MiB or None when NVML will not say)

    def to_dict(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "ppid": self.ppid,
            "role": self.role,
            "label": self.label,
            "rank": self.rank,
            "gpus": [{"index": i, "used_mib": mib} for i, mib in self.gpu_mib],
        }


def classify(pid: int, root_pid: int, name: str, cmdline: str) -> tuple[str, str, int | None]:
    """(role, label, rank) from a process's name and command line."""
    if pid == root_pid:  # what `vllm serve` itself became, whatever it calls itself
        return "api_server", "API server", None
    title = f"{cmdline} {name}"
    m = _WORKER.search(title)
    if m:
        rank = _RANK.search(m.group(1))
        return "worker", m.group(1), int(rank.group(1)) if rank else 0
    m = _ENGINE.search(title)
    if m:
        return "engine_core", "EngineCore" + (m.group(1) or ""), None
    if _API.search(title):
        return "api_server", "API server", None
    if "multiprocessing.resource_tracker" in cmdline:
        return "resource_tracker", "resource_tracker", None
    return "other", name or "?", None


def describe_tree(table: ProcessTable, root_pid: int) -> list[TreeMember]:
    """The live members under (and including) `root_pid`, API server first, workers by rank."""
    root = table.get(root_pid)
    if root is None:
        return []
    members = []
    for p in (root, *table.descendants(root_pid)):
        role, label, rank = classify(p.pid, root_pid, p.name, " ".join(p.cmdline))
        members.append(TreeMember(p.pid, p.ppid, role, label, rank))
    return sorted(members, key=lambda m: (ROLE_ORDER[m.role], m.rank if m.rank is not None else -1, m.pid))


def with_gpu_memory(members: Iterable[TreeMember], probe: GpuProbe, gpus: Iterable[int]) -> list[TreeMember]:
    """Attach each member's per-GPU memory as NVML lists it; GpuUnavailable propagates."""
    used: dict[int, list[tuple[int, int | None]]] = {}
    for index in gpus:
        for proc in probe.processes(index):
            used.setdefault(proc.pid, []).append((index, proc.used_mib))
    return [dataclasses.replace(m, gpu_mib=tuple(used.get(m.pid, ()))) for m in members]
