"""What vLLM's weight-cache daemons hold, asked the way vLLM asks (docs/weight-holder.md).

An engine that maps held weights subtracts from `total x --gpu-memory-utilization` only what the daemon's
PyTorch allocator holds (v1/worker/utils.py:716-768 request_memory), which it learns by sending
`{"cmd": "get_memory"}` to each daemon's socket (ipc_loader.py:121-165; the answer is
`torch.accelerator.memory_allocated()`, daemon.py:419-426).  NVML shows more for the same process: its CUDA
context, NCCL's buffers and the allocator's cached blocks.  So the preflight asks the daemons the same question,
and credits that, never what NVML shows.

The daemon answers only its own user (SO_PEERCRED, protocol.py:212-228), so the question is asked from a short
stdlib-only interpreter running as the socket's owner, which prints JSON; its reply is unpickled with no
globals allowed, so a daemon's bytes can build nothing but plain values.  The daemon's PID comes from the same
connection (SO_PEERCRED of the listening socket), which is how a reply is matched to NVML's process list.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from kimi_supervisor.untrusted_json import parse_json

# protocol.py:42 SOCKET_NAME_TEMPLATE "vllm_weight_cache_{gpu_uuid}{role}.sock", the target and draft groups.
SOCKET_GLOB = "vllm_weight_cache_*.sock"
QUERY_TIMEOUT_S = 5.0
SYSTEM_PYTHON = "/usr/bin/python3"

_ASK = r"""
import io, json, pickle, socket, struct, sys
LEN = struct.Struct("!Q")
class NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}")
def exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)
out = {}
for path in sys.argv[1:]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(path)
            pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            body = pickle.dumps({"cmd": "get_memory"}, protocol=pickle.HIGHEST_PROTOCOL)
            s.sendall(LEN.pack(len(body)) + body)
            (n,) = LEN.unpack(exact(s, LEN.size))
            if n > 1 << 20:
                raise ValueError(f"a {n}-byte reply")
            reply = NoGlobals(io.BytesIO(exact(s, n))).load()
        if not isinstance(reply, dict) or reply.get("status") != "ok" or type(reply.get("memory_bytes")) is not int:
            raise ValueError(f"reply {str(reply)[:200]}")
        out[path] = {"pid": pid, "bytes": reply["memory_bytes"]}
    except Exception as exc:
        out[path] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
print(json.dumps(out))
"""


def _ask_as(uid: int, gid: int, paths: list[str]) -> dict[str, dict[str, object]]:
    as_owner: dict[str, object] = {} if uid == os.geteuid() else {"user": uid, "group": gid, "extra_groups": []}
    # The script is stdlib only: as another user, the system's Python, since ours may sit in root's 0700 home.
    python = SYSTEM_PYTHON if as_owner and os.path.exists(SYSTEM_PYTHON) else sys.executable
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", _ASK, *paths],
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S * (len(paths) + 1),
            cwd="/",
            env={},
            **as_owner,  # type: ignore[call-overload]
        )
        parsed = parse_json(done.stdout.strip().splitlines()[-1].encode()) if done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {p: {"error": f"the query did not run: {exc}"} for p in paths}
    if not isinstance(parsed, dict):
        return {p: {"error": f"the query failed: {done.stderr.strip()[-300:]}"} for p in paths}
    return {str(k): v for k, v in parsed.items() if isinstance(v, dict)}


def allocated(socket_dir: Path) -> tuple[dict[int, int], list[str]]:
    """({daemon PID: bytes its PyTorch allocator holds}, one line per socket that did not answer)."""
    by_owner: dict[tuple[int, int], list[str]] = {}
    try:
        entries = sorted(socket_dir.glob(SOCKET_GLOB))
    except OSError as exc:
        return {}, [f"{socket_dir}: {exc}"]
    for path in entries:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            by_owner.setdefault((st.st_uid, st.st_gid), []).append(str(path))
    held: dict[int, int] = {}
    unanswered: list[str] = []
    for (uid, gid), names in by_owner.items():
        for name, answer in _ask_as(uid, gid, names).items():
            pid, nbytes = answer.get("pid"), answer.get("bytes")
            if isinstance(pid, int) and isinstance(nbytes, int):
                held[pid] = held.get(pid, 0) + nbytes
            else:
                unanswered.append(f"{Path(name).name}: {answer.get('error', 'no answer')}")
    return held, unanswered
