"""Server-sent events as the front reads and writes them (kimi_supervisor/deployment/front/sse.py): the one framing
writes a read's events as one bytes, each event as vLLM frames it, and the splitter reads them back."""

from __future__ import annotations

from kimi_supervisor.deployment.front import sse


def test_one_framing_for_one_event_and_for_a_batch() -> None:
    assert sse.frame([]) == b""
    assert sse.frame([sse.DONE]) == b"data: [DONE]\n\n"
    batch = [b'{"a":1}', b'{"b":2}', sse.DONE]
    framed = sse.frame(batch)
    assert framed == b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert framed == b"".join(sse.frame([data]) for data in batch)


def test_framed_events_split_back_whatever_the_reads_cut() -> None:
    batch = [b'{"a":1}', b'{"b":"x\\ny"}', sse.DONE]
    framed = sse.frame(batch)
    for cut in range(len(framed) + 1):
        splitter = sse.EventSplitter()
        events = splitter.feed(framed[:cut]) + splitter.feed(framed[cut:])
        assert [sse.data_of(e) for e in events] == batch


def test_a_chunk_the_front_writes_has_vllms_bytes_not_json_dumps_defaults() -> None:
    """vLLM writes each chunk with pydantic's model_dump_json: no spaces after separators, characters unescaped.
    The front's own chunks (a resumed stream's) had `json.dumps`'s `", "` and `\\u00e9`: the same JSON, other bytes."""
    doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": "café ☕", "logprobs": None}]}
    assert sse.encode(doc) == '{"id":"cmpl-1","choices":[{"index":0,"text":"café ☕","logprobs":null}]}'.encode()
