"""vLLM's Prometheus `/metrics`, read with prometheus_client's own parser.

The liveness check (is the engine producing tokens?) and the drain status
(how many requests are still in flight?) both need the same three numbers.
vLLM labels every sample by model and engine; the numbers are summed over
them.  A metric vLLM does not expose stays None, so callers can tell
"zero" from "unknown" (names moved between vLLM versions).
"""

from __future__ import annotations

import dataclasses
import http.client
import time
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"  # a counter: its family is "vllm:generation_tokens"

MAX_BYTES = 4 << 20  # a /metrics page is tens of KiB; never buffer an unbounded answer


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    running: float | None
    waiting: float | None
    generation_tokens: float | None

    @property
    def in_flight(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


class MetricsError(Exception):
    """/metrics could not be read or parsed; the message is one line."""


_FAMILIES = (RUNNING, WAITING, GENERATION_TOKENS.removesuffix("_total"))


def _wanted_lines(text: str) -> str:
    """Only the lines of the families we read: a real page is ~50 KB, ~600 lines, and parsing all of it costs
    ~15 ms of CPU every few seconds; the three families parse in well under a millisecond."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(_FAMILIES):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_metrics(text: str) -> EngineMetrics:
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_wanted_lines(text)):
            for sample in family.samples:
                if sample.name in (RUNNING, WAITING, GENERATION_TOKENS):
                    sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except ValueError as exc:
        raise MetricsError(f"unparseable /metrics: {exc}") from None
    return EngineMetrics(sums.get(RUNNING), sums.get(WAITING), sums.get(GENERATION_TOKENS))


def fetch_metrics(url: str, timeout_s: float) -> EngineMetrics:
    """GET `url` (vLLM's /metrics) within `timeout_s` overall, not per read."""
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout_s
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/metrics", headers={"User-Agent": "kimi-supervisor"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise MetricsError(f"GET {parts.path}: HTTP {resp.status}")
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MetricsError(f"GET {parts.path}: no complete answer within {timeout_s:g}s")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_BYTES:
                raise MetricsError(f"GET {parts.path}: answer larger than {MAX_BYTES} bytes")
            chunks.append(chunk)
    except (OSError, http.client.HTTPException) as exc:
        raise MetricsError(f"GET {parts.path}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    return parse_metrics(b"".join(chunks).decode("utf-8", "replace"))
