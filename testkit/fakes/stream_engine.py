"""An engine stand-in for the front's benchmark: `vllm serve --uds PATH` as the front sees it on the wire, with no
model behind it, so that what limits a stream is CPU (its own, the front's, the client's), never inference.

Stdlib only, one asyncio protocol per connection (HTTP/1.1 keep-alive, Content-Length request bodies): it must
cost less per token than the front it is compared with, or the comparison measures the stand-in.  It answers

* `GET /health`: 200, empty, as vLLM's;
* `POST /v1/completions` non-streamed: one `text_completion` document (vLLM 0.32's CompletionResponse fields);
* `POST /v1/completions` with `stream: true`: one `data:` event per token, written as one HTTP chunk each as
  uvicorn writes a StreamingResponse's pieces, in the byte shape of vLLM 0.32's
  `CompletionStreamResponse.model_dump_json(exclude_unset=True)`
  (vllm/entrypoints/openai/completion/serving.py: id, object, created, model, then each choice's index, text,
  logprobs, finish_reason, stop_reason, prompt_token_ids (a list on the first chunk when `return_token_ids`),
  token_ids), then `data: [DONE]`.  Tokens go out as fast as the reader takes them (`--pace-tok-s 0`) or at a
  fixed rate per stream, like a GPU's decode steps.

Usage: python3 -m testkit.fakes.stream_engine --socket PATH [--pace-tok-s 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
from typing import Any

_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: %s\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _date() -> bytes:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()).encode()


def token_text(token: int) -> str:
    return f" w{token % 1000}"


def stream_events(body: dict[str, Any], request_id: str, created: int) -> list[bytes]:
    """The data events of one streamed completion, each with its terminating blank line, [DONE] last."""
    count = int(body.get("max_tokens") or 16)
    ids = body.get("return_token_ids") is True
    model = json.dumps(str(body.get("model") or "tiny"))
    head = f'{{"id":"{request_id}","object":"text_completion","created":{created},"model":{model},"choices":['
    prompt = [ord(c) % 997 for c in str(body.get("prompt") or "")] or [1]
    events = []
    for n in range(count):
        token = 1000 + (n * 37 + len(prompt)) % 30000
        finish = '"length"' if n == count - 1 else "null"
        prompt_ids = json.dumps(prompt, separators=(",", ":")) if ids and n == 0 else "null"
        token_ids = f"[{token}]" if ids else "null"
        choice = (
            f'{{"index":0,"text":{json.dumps(token_text(token))},"logprobs":null,"finish_reason":{finish},'
            f'"stop_reason":null,"prompt_token_ids":{prompt_ids},"token_ids":{token_ids}}}'
        )
        events.append(f"data: {head}{choice}]}}\n\n".encode())
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        usage = f'{{"prompt_tokens":{len(prompt)},"total_tokens":{len(prompt) + count},"completion_tokens":{count}}}'
        events.append(f'data: {head}],"usage":{usage}}}\n\n'.encode())
    events.append(b"data: [DONE]\n\n")
    return events


def whole_answer(body: dict[str, Any], request_id: str, created: int) -> bytes:
    count = int(body.get("max_tokens") or 16)
    text = "".join(token_text(1000 + n) for n in range(count))
    doc = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": str(body.get("model") or "tiny"),
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 2, "total_tokens": 2 + count, "completion_tokens": count},
        "kv_transfer_params": None,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class _Connection(asyncio.Protocol):
    def __init__(self, engine: StreamEngine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False  # a response is being written: requests wait (HTTP/1.1 keeps their order)
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.can_write.set()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        method, path, _ = head[0].split(" ", 2)
        self.busy = True
        asyncio.get_running_loop().create_task(self._answer(method, path, body))

    async def _answer(self, method: str, path: str, raw: bytes) -> None:
        with contextlib.suppress(ConnectionError):  # the reader went away: the next request, if any, is its own
            await self._respond(method, path, raw)
        self.busy = False
        if self.transport is not None:
            self._next()

    def _send(self, status: str, content_type: str, body: bytes) -> None:
        assert self.transport is not None
        head = f"HTTP/1.1 {status}\r\ndate: {_date().decode()}\r\nserver: uvicorn\r\ncontent-length: {len(body)}\r\n"
        if content_type:
            head += f"content-type: {content_type}\r\n"
        self.transport.write(head.encode() + b"\r\n" + body)

    async def _respond(self, method: str, path: str, raw: bytes) -> None:
        if self.transport is None:
            return
        if method == "GET" and path == "/health":
            self._send("200 OK", "", b"")
            return
        if method != "POST" or path != "/v1/completions":
            self._send("404 Not Found", "application/json", b'{"detail":"Not Found"}')
            return
        body = json.loads(raw)
        self.engine.requests += 1
        request_id = f"cmpl-{os.urandom(16).hex()}"
        created = int(time.time())
        if not body.get("stream"):
            self._send("200 OK", "application/json", whole_answer(body, request_id, created))
            return
        self.transport.write(_HEAD % _date())
        loop = asyncio.get_running_loop()
        interval = 1.0 / self.engine.pace_tok_s if self.engine.pace_tok_s > 0 else 0.0
        due = loop.time()
        for event in stream_events(body, request_id, created):
            if self.transport is None:
                raise ConnectionResetError
            self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
            if not self.can_write.is_set():
                await self.can_write.wait()
            if interval:
                due += interval
                await asyncio.sleep(max(0.0, due - loop.time()))
            else:
                await asyncio.sleep(0)  # the other streams' turn, as an engine step serves every sequence
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")


class StreamEngine:
    def __init__(self, pace_tok_s: float = 0.0) -> None:
        self.pace_tok_s = pace_tok_s
        self.requests = 0

    async def serve(self, socket: str, stop: asyncio.Event) -> None:
        server = await asyncio.get_running_loop().create_unix_server(lambda: _Connection(self), socket)
        async with server:
            await stop.wait()


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await StreamEngine(args.pace_tok_s).serve(args.socket, stop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--pace-tok-s", type=float, default=0.0, help="tokens per second per stream; 0: unpaced")
    asyncio.run(_main(parser.parse_args()))
