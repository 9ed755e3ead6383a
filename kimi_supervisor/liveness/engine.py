"""Deep liveness: is the engine working, not just the HTTP server answering?

vLLM's /health reports only its engine-dead flag: it answers 200 through a GPU
page fault or an NCCL hang.  Three signals, each from its own daemon thread so
the supervisor's loop never blocks, each judged in the loop (`check()`):

* the canary: a 1-token completion every `canary_interval_s` (when the engine
  is idle by its own metrics, or always); `failures_tolerated` failures in a
  row mean wedged.  After a failure the next canary follows within a second,
  and the watchdog is not pinged until one passes again;
* token progress: requests running (`vllm:num_requests_running` > 0) while
  `vllm:generation_tokens_total` stays put for `stuck_after_s` means wedged;
* GPU events (gpu_events.py): an XID or double-bit ECC error on our GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping

from kimi_supervisor.config.model import Config
from kimi_supervisor.exitcodes import EngineWedged
from kimi_supervisor.host.gpu import GpuProbe
from kimi_supervisor.liveness.gpu_events import GpuEventWatcher
from kimi_supervisor.liveness.http import HttpClient, one_line, request
from kimi_supervisor.liveness.vllm_metrics import EngineMetrics, MetricsError, fetch_metrics
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.systemd.notify import Notifier
from kimi_supervisor.untrusted_json import parse_json

RETRY_S = 1.0  # after a failed canary, the next one follows this soon (not a whole interval later)
CANARY_PROMPT = "Hi"
MAX_CANARY_BODY = 1 << 20  # a 1-token completion is < 1 KiB


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    ok: bool
    error: str | None
    latency_s: float


def api_key(argv: tuple[str, ...], env: Mapping[str, str]) -> str | None:
    """vLLM's --api-key (or VLLM_API_KEY): with one set, /v1/* refuses requests without it (HTTP 401)."""
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--api-key="):
            return arg.partition("=")[2]
    return env.get("VLLM_API_KEY") or None


def send_canary(
    url: str, model: str, timeout_s: float, key: str | None = None, http: HttpClient = request
) -> CanaryResult:
    """POST a 1-token, temperature-0 completion; ok means HTTP 200 with a choice, all of it within `timeout_s`."""
    body = json.dumps({"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "kimi-supervisor canary"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    a = http("POST", url, timeout_s, body=body, headers=headers, max_body=MAX_CANARY_BODY)
    if a.error is not None:
        return CanaryResult(False, a.error, a.latency_s)
    if a.http_status != 200:
        return CanaryResult(
            False, one_line(f"HTTP {a.http_status}: {a.body[:200].decode('utf-8', 'replace')}"), a.latency_s
        )
    try:
        doc = parse_json(a.body)
    except ValueError as exc:
        return CanaryResult(False, f"HTTP 200, {exc}", a.latency_s)
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return CanaryResult(False, "HTTP 200 without a completion choice", a.latency_s)
    return CanaryResult(True, None, a.latency_s)


def served_model(
    url: str, timeout_s: float, key: str | None = None, http: HttpClient = request
) -> tuple[str | None, str | None]:
    """vLLM's own answer to "which model do you serve": the first id of GET /v1/models (its primary served
    name, vllm/entrypoints/openai/models/serving.py); (id, None) or (None, why not)."""
    headers = {"User-Agent": "kimi-supervisor canary"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    a = http("GET", url, timeout_s, headers=headers, max_body=MAX_CANARY_BODY)
    if a.error is not None:
        return None, f"GET /v1/models: {a.error}"
    if a.http_status != 200:
        return None, one_line(f"GET /v1/models: HTTP {a.http_status}: {a.body[:200].decode('utf-8', 'replace')}")
    try:
        doc = parse_json(a.body)
    except ValueError as exc:
        return None, f"GET /v1/models: HTTP 200, {exc}"
    data = doc.get("data") if isinstance(doc, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model = first.get("id") if isinstance(first, dict) else None
    if not isinstance(model, str) or not model:
        return None, "GET /v1/models: HTTP 200 without a model id"
    return model, None


class ProgressTracker:
    """Pure: fed metrics samples, says when running requests have produced no token for `stuck_after_s`."""

    def __init__(self, stuck_after_s: float) -> None:
        self.stuck_after_s = stuck_after_s
        self._tokens: float | None = None
        self._since: float | None = None  # when the current token count was first seen with requests running

    def observe(self, at: float, m: EngineMetrics) -> str | None:
        if m.running is None or m.generation_tokens is None or m.running <= 0:
            self._tokens, self._since = m.generation_tokens, None
            return None
        if self._since is None or m.generation_tokens != self._tokens:
            self._tokens, self._since = m.generation_tokens, at
            return None
        stalled = at - self._since
        if stalled < self.stuck_after_s:
            return None
        return (
            f"{m.running:g} request(s) running and vllm:generation_tokens_total stuck at {m.generation_tokens:g} "
            f"for {stalled:.1f}s (liveness.stuck_after_s = {self.stuck_after_s:g})"
        )


@dataclasses.dataclass(frozen=True)
class LivenessInputs:
    """What a liveness is built from once READY (lifecycle.deps.LivenessFactory takes one)."""

    cfg: Config
    probe: GpuProbe
    gpus: tuple[int, ...]  # the GPUs to watch
    wake: Callable[[], None]  # the loop's wake-up
    notifier: Notifier
    log: Logger
    environ: Mapping[str, str]  # the environment the child got (its VLLM_API_KEY)
    on_canary: Callable[[bool, float], None] | None = None  # each canary's (ok, latency_s): the operator's view
    http: HttpClient = request


class DeepLiveness:
    """Canary, token progress and GPU events while serving; the supervisor's loop calls `check()`."""

    def __init__(self, given: LivenessInputs) -> None:
        cfg, probe, gpus, wake, notifier, log = (
            given.cfg,
            given.probe,
            given.gpus,
            given.wake,
            given.notifier,
            given.log,
        )
        on_canary, http, environ = given.on_canary, given.http, given.environ
        self.cfg = cfg.liveness
        self._http = http
        self._on_canary = on_canary  # the operator's view: the state file and metrics show each result
        # None when argv names the model in a form the parser does not know: the canary asks vLLM (/v1/models)
        # rather than turning itself off, so the deployment never runs unwatched.
        self.model = cfg.child.vllm.served_model_name
        self.completions_url = cfg.child.vllm.api_url("/v1/completions")
        self.models_url = cfg.child.vllm.api_url("/v1/models")
        # The environment the child was spawned with (Deps.environ): its VLLM_API_KEY is the one vLLM checks.
        env = {**(environ if cfg.child.inherit_environment else {}), **cfg.child.env}
        self._key = api_key(cfg.child.argv, env)  # never logged
        self._wake = wake
        self._notifier = notifier
        self._log = log
        self._stop = threading.Event()
        self._canaries: queue.SimpleQueue[CanaryResult] = queue.SimpleQueue()
        self._samples: queue.SimpleQueue[tuple[float, EngineMetrics | str]] = queue.SimpleQueue()
        self._latest: EngineMetrics | None = None  # written by the metrics thread, read by the canary thread
        self._latest_in_flight: tuple[float, float] | None = None  # (monotonic, count): read by the stop
        self._tracker = ProgressTracker(self.cfg.stuck_after_s)
        self._threads: list[threading.Thread] = []
        self.canary_failures = 0
        self.canaries_ok = 0
        self._metrics_error = ""
        self._metrics_missing_logged = False
        self.gpu_events: GpuEventWatcher | None = None
        if cfg.gpu_health.xid_events and gpus:
            self.gpu_events = GpuEventWatcher(probe, gpus, cfg.gpu_health.xid_ignored, wake, log)

    @property
    def canary_on(self) -> bool:
        return self.cfg.canary_interval_s > 0

    @property
    def healthy(self) -> bool:
        """False while a canary failure streak lasts: the watchdog is not pinged then."""
        return self.canary_failures == 0

    def in_flight_sample(self) -> tuple[float, float] | None:
        """The metrics thread's latest (monotonic time, requests running + waiting); None if it has none."""
        return self._latest_in_flight

    def start(self) -> None:
        c = self.cfg
        if self.canary_on:
            self._threads.append(threading.Thread(target=self._canary_loop, name="canary", daemon=True))
        if c.stuck_after_s > 0 or (self.canary_on and c.when == "idle"):
            self._threads.append(threading.Thread(target=self._metrics_loop, name="metrics", daemon=True))
        for t in self._threads:
            t.start()
        if self.gpu_events is not None:
            self.gpu_events.start()
        self._log.info(
            "liveness.started",
            canary_interval_s=c.canary_interval_s if self.canary_on else 0,
            canary_when=c.when,
            model=self.model,
            stuck_after_s=c.stuck_after_s,
            gpu_events=self.gpu_events is not None,
        )

    def stop(self) -> None:
        """Returns at once: the threads notice within their wait; nothing they produce is judged any more."""
        self._stop.set()
        if self.gpu_events is not None:
            self.gpu_events.stop()

    def close(self) -> None:
        self.stop()
        if self.gpu_events is not None:
            self.gpu_events.close()

    # -- threads: they only produce results ------------------------------------------

    def _canary_loop(self) -> None:
        c = self.cfg
        wait = c.canary_interval_s
        while not self._stop.wait(wait):
            latest = self._latest
            if c.when == "idle" and latest is not None and (latest.in_flight or 0) > 0:
                wait = c.canary_interval_s  # busy: token progress is the check that applies
                continue
            model = self.model if self.model is not None else self._ask_model()
            if isinstance(model, str):
                result = send_canary(self.completions_url, model, c.canary_timeout_s, self._key, self._http)
            else:
                result = model
            if self._stop.is_set():
                return
            self._canaries.put(result)
            self._wake()
            wait = c.canary_interval_s if result.ok else min(c.canary_interval_s, RETRY_S)

    def _ask_model(self) -> str | CanaryResult:
        """No model from argv: vLLM names it.  A vLLM that cannot is a failed canary, counted like any other."""
        start = time.monotonic()
        model, error = served_model(self.models_url, self.cfg.canary_timeout_s, self._key, self._http)
        if model is None:
            return CanaryResult(False, f"no model to name in the canary: {error}", time.monotonic() - start)
        self._log.info("liveness.canary_model", model=model, source="GET /v1/models (not in child.argv)")
        self.model = model
        return model

    def _metrics_loop(self) -> None:
        c = self.cfg
        while not self._stop.wait(c.metrics_interval_s):
            sample: EngineMetrics | str
            try:
                self._latest = sample = fetch_metrics(c.metrics_url, min(c.metrics_interval_s, 10.0), self._http)
                if sample.in_flight is not None:
                    self._latest_in_flight = (time.monotonic(), sample.in_flight)
            except MetricsError as exc:
                sample, self._latest = str(exc), None
            self._samples.put((time.monotonic(), sample))
            self._wake()

    # -- the loop's side ----------------------------------------------------------------

    def check(self) -> None:
        """Judge what the threads produced; raise EngineWedged or GpuFailed."""
        self._check_canaries()
        self._check_progress()
        if self.gpu_events is not None:
            self.gpu_events.check()

    def _check_canaries(self) -> None:
        c = self.cfg
        while True:
            try:
                r = self._canaries.get_nowait()
            except queue.Empty:
                return
            if self._on_canary is not None:
                self._on_canary(r.ok, r.latency_s)
            latency_ms = round(r.latency_s * 1000, 1)
            if r.ok:
                if self.canary_failures:
                    self._log.info("liveness.canary_recovered", after_failures=self.canary_failures)
                self.canaries_ok += 1
                (self._log.info if self.canaries_ok == 1 else self._log.debug)(
                    "liveness.canary_ok", latency_ms=latency_ms, model=self.model
                )
                self.canary_failures = 0
                continue
            self.canary_failures += 1
            self._log.warning(
                "liveness.canary_failed",
                failures=self.canary_failures,
                tolerated=c.failures_tolerated,
                error=r.error,
                latency_ms=latency_ms,
            )
            self._notifier.send(
                STATUS=f"ready, but the canary completion is failing "
                f"({self.canary_failures}/{c.failures_tolerated}): {r.error}"[:400]
            )
            if self.canary_failures >= c.failures_tolerated:
                raise EngineWedged(
                    f"engine wedged: the 1-token canary completion failed {self.canary_failures} times in a row "
                    f"({r.error})"
                )

    def _check_progress(self) -> None:
        while True:
            try:
                at, sample = self._samples.get_nowait()
            except queue.Empty:
                return
            if isinstance(sample, str):
                if sample != self._metrics_error:
                    self._log.warning("liveness.metrics_unavailable", error=sample)
                self._metrics_error = sample
                continue
            self._metrics_error = ""
            if (sample.running is None or sample.generation_tokens is None) and not self._metrics_missing_logged:
                self._metrics_missing_logged = True
                self._log.warning(
                    "liveness.metrics_missing",
                    why="vllm:num_requests_running or vllm:generation_tokens_total not in /metrics: "
                    "token progress is not checked",
                )
            if self.cfg.stuck_after_s <= 0:
                continue
            verdict = self._tracker.observe(at, sample)
            if verdict is not None:
                raise EngineWedged(f"engine wedged: {verdict}")
