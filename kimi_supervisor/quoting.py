"""Quoting a line of the child's output inside the supervisor's own words, and the escapers every other
text from outside goes through.

What vLLM printed may hold a client's text (a model name, a prompt): it is never the message, only quoted in
it, escaped so that no quote, backslash, newline or terminal escape in it can end the quote, fake a line or
drive a terminal that later shows the state file, the history or the journal.  Two escapers, one notation
(`\\x1b`, `\\u2028`): `escape_controls` for text kept on one line (log fields, the preflight report), and
`escape_unprintable` for text a terminal shows (`status`, a peer's answer), which also escapes bidi and other
format characters.  tests/test_comment_paths.py fails when a third appears.
"""

from __future__ import annotations

import re

# C0, DEL, C1 (ESC and CSI start terminal sequences), and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
QUOTE_LIMIT = 400


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_controls(text: str) -> str:
    """`text` on one line: every control character (C0, DEL, C1, U+2028/9) escaped (`\\x0a`, `\\u2028`)."""
    return _CONTROL.sub(lambda m: _escaped(m.group()), text)


def escape_unprintable(text: object) -> str:
    """`text` with every character a terminal could act on escaped: C0/C1 controls (ESC), DEL, bidi and
    other format characters, line/paragraph separators, lone surrogates (which would not even encode)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escaped(ch) for ch in text)


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`"text"`, with `\\`, `"` and control characters escaped (`\\x1b`), cut at `limit` characters (`..."`)."""
    cut = text[:limit]
    escaped = cut.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escape_controls(escaped)
    return f'"{escaped}{"..." if len(text) > limit else ""}"'
