"""NCCL's RAS status, asked the way NCCL's own client (`ncclras`) asks, for an incident file.

NCCL >= 2.24 runs a RAS service in every process of a communicator; the one on this host listens on
NCCL_RAS_ADDR (the deployment's own port: config/gpu_pinning.py).  The conversation, as NVIDIA/nccl's
src/ras/client.cc (the client) and src/ras/client_support.cc (the service) have it, one line each way:
  CLIENT PROTOCOL 2      ->  SERVER PROTOCOL <n>   (the service's version; a mismatch still goes on)
  TIMEOUT <s>            ->  OK                    (how long NCCL waits for its peers' answers; older: ERROR)
  VERBOSE STATUS         ->  the report, text, then the service closes the connection (the end is EOF)
Every step is bounded by one deadline: what came before it is kept and the note says where it stopped.  No
listener (no NCCL communicator yet, NCCL older than 2.24, NCCL_RAS_ENABLE=0) is one line in the file, never
a failure.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time

CLIENT_PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL in src/ras/ras_internal.h
MAX_REPORT_BYTES = 1 << 20  # a verbose report of a few hundred ranks is tens of KiB


@dataclasses.dataclass(frozen=True)
class RasStatus:
    address: str
    seconds: float
    text: str | None  # the report (or what of it came within the bound)
    note: str | None  # why there is no report, or why it is partial; None: the whole report


def query(host: str, port: int, timeout_s: float) -> RasStatus:
    """VERBOSE STATUS from the RAS service at host:port, within `timeout_s` in all; never raises OSError."""
    start = time.monotonic()
    deadline = start + timeout_s
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    received = bytearray()
    note: str | None = None
    step = "connecting"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    try:
        with socket.create_connection((host, port), timeout=left()) as sock:
            buffered = bytearray()

            def line() -> str:
                while b"\n" not in buffered:
                    sock.settimeout(left())
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ConnectionResetError("the service closed the connection")
                    buffered.extend(chunk)
                head, _, rest = buffered.partition(b"\n")
                buffered[:] = rest
                return head.decode("utf-8", "replace").strip()

            step = "the protocol handshake"
            sock.sendall(f"CLIENT PROTOCOL {CLIENT_PROTOCOL}\n".encode())
            answer = line()
            if not answer.upper().startswith("SERVER PROTOCOL "):
                return RasStatus(address, _since(start), None, f"not NCCL's RAS service: it answered {answer[:200]!r}")
            step = "TIMEOUT"
            # NCCL's own wait for its peers, in whole seconds, inside ours so that its answer can still reach us.
            sock.sendall(f"TIMEOUT {max(1, math.floor(left() / 2))}\n".encode())
            answer = line()
            if answer.upper() != "OK":
                note = f"TIMEOUT refused ({answer[:200]}): NCCL's own peer timeout applies"
            step = "the report"
            sock.sendall(b"VERBOSE STATUS\n")
            received.extend(buffered)
            while len(received) < MAX_REPORT_BYTES:
                sock.settimeout(left())
                chunk = sock.recv(65536)
                if not chunk:
                    break  # the service closes the connection once the report is sent
                received.extend(chunk)
            else:
                note = f"report cut at {MAX_REPORT_BYTES} bytes"
    except ConnectionRefusedError:
        return RasStatus(address, _since(start), None, f"no RAS listener at {address} (connection refused)")
    except TimeoutError:
        note = f"no answer to {step} within {timeout_s:g}s"
    except OSError as exc:
        note = f"{step}: {exc}"[:300]
    text = received.decode("utf-8", "replace") if received else None
    return RasStatus(address, _since(start), text, note)


def _since(start: float) -> float:
    return round(time.monotonic() - start, 3)
