"""Failure text: the supervisor's own words, vLLM's line only ever quoted and escaped."""

from __future__ import annotations

from kimi_supervisor.child.readiness import ReadinessTracker
from kimi_supervisor.quoting import quote
from tests.child.test_readiness import CFG


def test_quote_escapes_what_could_end_the_quote_fake_a_line_or_drive_a_terminal() -> None:
    assert quote("plain") == '"plain"'
    assert quote('a "b" \\ c') == '"a \\"b\\" \\\\ c"'
    assert quote("x\ny\r\x1b[31mred\x07\u2028z") == '"x\\x0ay\\x0d\\x1b[31mred\\x07\\u2028z"'
    assert quote("a" * 500) == '"' + "a" * 400 + '..."'
    for hostile in ['"; rm -rf / #', "\n(APIServer pid=1) INFO faked", "\x1b]0;title\x07"]:
        quoted = quote(hostile)
        inner = quoted[1:-1]
        assert quoted.startswith('"') and quoted.endswith('"')
        assert "\n" not in quoted and "\x1b" not in quoted and "\x07" not in quoted
        assert '"' not in inner.replace('\\"', "")  # every quote inside is escaped


def test_a_fatal_failure_message_quotes_the_line_never_repeats_it_raw() -> None:
    t = ReadinessTracker(CFG)
    line = (
        '(EngineCore pid=5) ERROR 11-29 17:08:21 [multiproc_executor.py:315] Worker proc "x"\x1b[2J died '
        "unexpectedly (exit code: -9)"
    )
    assert t.feed(line).fatal
    message = f"vLLM reported a fatal error after it was ready: {quote(t.root_cause())}"
    assert "\x1b" not in message and '\\"x\\"\\x1b[2J' in message
