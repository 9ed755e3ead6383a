"""vLLM's /metrics: parsed with prometheus_client, read with one overall deadline."""

from __future__ import annotations

import http.server
import time
from collections.abc import Iterator

import pytest

from kimi_supervisor.liveness.vllm_metrics import EngineMetrics, MetricsError, fetch_metrics, parse_metrics
from testkit.harness import http_server

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 17.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
"""


def test_parse_sums_over_engines_and_ignores_created_samples() -> None:
    m = parse_metrics(PAGE)
    assert m == EngineMetrics(running=3.0, waiting=4.0, generation_tokens=17.0)
    assert m.in_flight == 7.0


def test_missing_metrics_are_unknown_not_zero() -> None:
    m = parse_metrics("# TYPE other gauge\nother 1\n")
    assert m == EngineMetrics(None, None, None)
    assert m.in_flight is None


def test_garbage_is_a_metrics_error() -> None:
    with pytest.raises(MetricsError, match="unparseable"):
        parse_metrics("vllm:num_requests_running{engine=0 2\n")


# The trickled answer: 300 bytes at 0.1 s each, 30 s in all; a client gone, the next write fails and ends it.
TRICKLE_BYTES = 300


class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "ok"

    def do_GET(self) -> None:
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        if self.mode == "trickle":
            for _ in range(TRICKLE_BYTES):  # one byte every 0.1 s: each read is quick, the whole is not
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.wfile.write(PAGE.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("H", (_Handler,), {})
    with http_server(handler) as base:
        yield f"{base}/metrics", handler


def test_fetch_reads_a_real_http_answer(server: tuple[str, type[_Handler]]) -> None:
    url, _ = server
    assert fetch_metrics(url, 2.0).running == 3.0


def test_fetch_http_error_is_named(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.mode = "500"
    with pytest.raises(MetricsError, match="HTTP 500"):
        fetch_metrics(url, 2.0)


def test_a_trickling_answer_hits_the_overall_deadline(server: tuple[str, type[_Handler]]) -> None:
    url, handler = server
    handler.mode = "trickle"
    start = time.monotonic()
    with pytest.raises(MetricsError, match=r"within 0\.5s"):
        fetch_metrics(url, 0.5)
    # The deadline ended it, not the answer: the whole one needs 30 s (a bound by cause, not this machine's speed).
    assert time.monotonic() - start < TRICKLE_BYTES * 0.1


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN", "-1"])
def test_non_finite_counts_are_a_metrics_error(value: str) -> None:
    # A count that is no count is a failed sample: the drain's STATUS= text did int() of it (OverflowError).
    with pytest.raises(MetricsError, match=r"unparseable /metrics: vllm:num_requests_running is .*: not a count"):
        parse_metrics(f"vllm:num_requests_running {value}\nvllm:num_requests_waiting 0\n")
