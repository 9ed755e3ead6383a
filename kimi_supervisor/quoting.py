"""Quoting a line of the child's output inside the supervisor's own words.

What vLLM printed may hold a client's text (a model name, a prompt): it is never the message, only quoted in
it, escaped so that no quote, backslash, newline or terminal escape in it can end the quote, fake a line or
drive a terminal that later shows the state file, the history or the journal.
"""

from __future__ import annotations

import re

# C0, DEL, C1 (ESC and CSI start terminal sequences), and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
QUOTE_LIMIT = 400


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """`text` on one line: every control character (C0, DEL, C1, U+2028/9) escaped (`\\x0a`, `\\u2028`)."""
    return _CONTROL.sub(_escape, text)


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`"text"`, with `\\`, `"` and control characters escaped (`\\x1b`), cut at `limit` characters (`..."`)."""
    cut = text[:limit]
    escaped = cut.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escape_controls(escaped)
    return f'"{escaped}{"..." if len(text) > limit else ""}"'
