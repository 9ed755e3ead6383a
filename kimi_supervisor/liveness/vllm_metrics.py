"""vLLM's Prometheus `/metrics`, read with prometheus_client's own parser.

The liveness check (is the engine producing tokens?) and the drain's progress
(how many requests are still in flight?) both need the same three numbers.
vLLM labels every sample by model and engine; the numbers are summed over
them.  A metric vLLM does not expose stays None, so callers can tell
"zero" from "unknown" (names moved between vLLM versions).
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from prometheus_client.parser import text_string_to_metric_families

from kimi_supervisor.liveness.http import HttpClient, finite_count, one_line, request

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
                    # +Inf or NaN in a count is no count: int() of it raised OverflowError in the stop loop.
                    value = finite_count(sample.name, float(sample.value))
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
    except (ValueError, IndexError, KeyError, TypeError) as exc:  # prometheus_client's parser raises all four
        raise MetricsError(one_line(f"unparseable /metrics: {exc}")) from None
    return EngineMetrics(sums.get(RUNNING), sums.get(WAITING), sums.get(GENERATION_TOKENS))


def fetch_metrics(url: str, timeout_s: float, http: HttpClient = request) -> EngineMetrics:
    """GET `url` (vLLM's /metrics) within `timeout_s` overall (httpget's deadline), or MetricsError."""
    path = urllib.parse.urlsplit(url).path or "/metrics"
    a = http("GET", url, timeout_s, max_body=MAX_BYTES)
    if a.error is not None:
        raise MetricsError(f"GET {path}: {a.error}")
    if a.http_status != 200:
        raise MetricsError(f"GET {path}: HTTP {a.http_status}")
    return parse_metrics(a.body.decode("utf-8", "replace"))
