"""The fake vLLM's HTTP API: the routes a supervisor (or its canary) calls, answered like vLLM 0.32.

A mode that changes an answer sets a flag on APP (from the APIServer's serve loop) and the route reads
it; a new route is one entry in ROUTES and one method.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NoReturn

from testkit.fakes.fake_vllm_options import Config
from testkit.fakes.fake_vllm_output import plain


class _AppState:
    cfg: Config
    hung = False  # --hang-after-ready: accept, never answer
    unhealthy = False  # --unhealthy-after: /health 503
    trickle = False  # --trickle-health-after: /health's answer one byte every 0.5 s
    engine_dead = False  # after engine death: /health 503, completions 500
    wedged = False  # --wedged-after: /health 200, completions never answered, /metrics frozen
    running = 0  # requests in the (wedged) engine
    answered = 0  # completions answered (--wedged-after-answers)
    generation_tokens = 0
    lock = threading.Lock()
    created = int(time.time())


APP = _AppState()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"

    def version_string(self) -> str:
        return "uvicorn"

    def log_message(self, fmt: str, *args: object) -> None:
        del fmt, args  # uvicorn's own access line is written by _send

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        if APP.hung:
            _hang()
        path = self.path.split("?", 1)[0]
        route = ROUTES.get(path)
        if route is None:
            self._json(404, {"detail": "Not Found"})
        elif route[0] != method:
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            route[1](self)

    # ---------------------------------------------------------------------------------------- routes

    def health(self) -> None:
        if APP.trickle:
            for byte in b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-length: 0\r\n\r\n":
                time.sleep(0.5)
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return  # the client gave up
            self._access_line(200)
            return
        self._send(503 if APP.unhealthy or APP.engine_dead else 200, b"", None)

    def version(self) -> None:
        self._json(200, {"version": "0.32.0"})

    def metrics(self) -> None:
        """vLLM 0.32's names and shapes (tests/fixtures/vllm_cpu_0.32/metrics_*.txt), three of its metrics."""
        labels = f'engine="0",model_name="{APP.cfg.served_name}"'
        with APP.lock:
            running, tokens = APP.running, APP.generation_tokens
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total{{{labels}}} {float(tokens)}\n"
            f"vllm:generation_tokens_created{{{labels}}} {float(APP.created)}\n"
        )
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def models(self) -> None:
        cfg = APP.cfg
        card = {
            "id": cfg.served_name,
            "object": "model",
            "created": APP.created,
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        self._json(200, {"object": "list", "data": [card]})

    def completions(self) -> None:
        body = self._body()
        model = body.get("model", APP.cfg.served_name)
        if model != APP.cfg.served_name:
            self._error(404, "NotFoundError", f"The model `{model}` does not exist.")
        elif APP.engine_dead:
            self._error(
                500, "InternalServerError", "EngineCore encountered an issue. See stack trace for the root cause."
            )
        elif APP.wedged:
            with APP.lock:
                APP.running += 1
            _hang()
        else:
            tokens = max(1, int(str(body.get("max_tokens", 16))))
            with APP.lock:
                APP.generation_tokens += tokens
            prompt_tokens = len(str(body.get("prompt", "")).split())
            choice = {"index": 0, "text": " ok" * tokens, "logprobs": None, "finish_reason": "length"}
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}
            usage["total_tokens"] = prompt_tokens + tokens
            reply = {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": APP.cfg.served_name,
                "choices": [choice],
                "usage": usage,
            }
            self._json(200, reply)
            with APP.lock:
                APP.answered += 1
                if APP.cfg.wedged_after_answers is not None and APP.answered >= APP.cfg.wedged_after_answers:
                    APP.wedged, APP.running = True, APP.running + 2  # as --wedged-after's

    # --------------------------------------------------------------------------------------- helpers

    def _body(self) -> dict[str, object]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _send(self, status: int, body: bytes, ctype: str | None) -> None:
        self.send_response(status)  # adds the Server and Date headers
        if ctype is not None:
            self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self._access_line(status)

    def _access_line(self, status: int) -> None:
        """uvicorn's access log, every request: the path percent-decoded then quoted again, the query as sent."""
        # A Unix socket's peer has no address (""): uvicorn logs it as it can.
        host, port = self.client_address[:2] if isinstance(self.client_address, tuple) else ("unix", 0)
        phrase = self.responses.get(status, ("",))[0]
        path, _, query = self.path.partition("?")
        shown = urllib.parse.quote(urllib.parse.unquote(path)) + (f"?{query}" if query else "")
        plain(f'INFO:     {host}:{port} - "{self.command} {shown} HTTP/1.1" {status} {phrase}', fd=1)

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, kind: str, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


ROUTES: dict[str, tuple[str, Callable[[Handler], None]]] = {
    "/health": ("GET", Handler.health),
    "/ping": ("GET", Handler.health),
    "/version": ("GET", Handler.version),
    "/metrics": ("GET", Handler.metrics),
    "/v1/models": ("GET", Handler.models),
    "/v1/completions": ("POST", Handler.completions),
}


def _hang() -> NoReturn:
    while True:
        time.sleep(3600)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
