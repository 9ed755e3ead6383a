"""`kimi-supervisor` with NVML replaced by GPUs described in a JSON file (tests only).

    python -m testkit.fakes.gpu_cli GPU_FILE [kimi-supervisor arguments...]

GPU_FILE holds `[{"total_mib": 97887, "occupants": {"PID": MiB, ...}}, ...]` and is
re-read on every probe call, so a test can hand a running supervisor's workers
a GPU context after it started: the file's occupants count only while alive,
as with the real driver.  Write it with `write_gpu_file` only: the running supervisor reads it at any moment,
and a file rewritten in place (truncate, then write) reads empty in between (`json.loads` of "" raised inside
the operator view: `operator_view.error` on a loaded machine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kimi_supervisor.cli import entry as cli
from kimi_supervisor.files.atomic import write_atomic
from testkit.fakes.gpu import FakeGpu, FakeGpuProbe


def write_gpu_file(path: Path, gpus: list[dict[str, object]]) -> Path:
    """GPU_FILE replaced whole (a new file renamed over it): a reader sees the old document or the new one."""
    write_atomic(path, json.dumps(gpus).encode())
    return path


def idle_gpus(count: int) -> list[dict[str, object]]:
    return [{"total_mib": 97887, "occupants": {}} for _ in range(count)]


class FileGpuProbe(FakeGpuProbe):
    def __init__(self, path: Path) -> None:
        super().__init__([])
        self.path = path

    def _check(self) -> None:
        super()._check()
        data = json.loads(self.path.read_text())
        self.gpus = [
            FakeGpu(
                total_mib=int(g.get("total_mib", 97887)),
                occupants={int(pid): mib for pid, mib in g.get("occupants", {}).items()},
            )
            for g in data
        ]


def main() -> int:
    path = Path(sys.argv[1])
    cli.NvmlProbe = lambda: FileGpuProbe(path)  # type: ignore[assignment,misc,return-value]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
