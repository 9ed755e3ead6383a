"""JSON that someone else wrote: a peer's or vLLM's HTTP answer, a file in a directory another account can
write, a model's config.  One parser for all of it (`parse_json`), so every reader refuses the same things.

Nothing in the bytes raises anything but `Untrusted` (a ValueError) with a one-line reason: not UTF-8, not
JSON, NaN or Infinity in any spelling (`NaN`, `-Infinity`, `1e400`), an integer of more digits than Python
converts, nesting too deep for json's recursion (100k `[`: RecursionError, no ValueError, would end the
thread that asked), or deeper than the reader's own `max_depth`, counted before the parser runs.
"""

from __future__ import annotations

import json
import math
import re

# JSON strings (with escapes) dropped before brackets are counted: a "[" inside a string is no nesting.  Written
# as runs between escapes, not one alternation per character: that form took 16 s for one 32 MiB string (the
# regex engine holds the GIL: a front's event loop stood still), this one 0.5 s (issue 49).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class Untrusted(ValueError):
    """Input from outside that is not something we read: the reason, in words."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Untrusted(f"number {text[:40]} is not finite")
    return value


def _no_constant(name: str) -> object:
    raise Untrusted(f"not JSON: {name}")


def parse_json(raw: bytes, max_depth: int | None = None) -> object:
    """The document in `raw`; Untrusted when it is not UTF-8 JSON of finite numbers (and, given `max_depth`,
    nested at most that deep)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Untrusted(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    if max_depth is not None and text.count("[") + text.count("{") > max_depth:  # fewer cannot nest deeper
        depth = deepest = 0
        for bracket in _BRACKET.finditer(_STRING.sub("", text)):
            depth += 1 if bracket.group() in "[{" else -1
            deepest = max(deepest, depth)
            if deepest > max_depth:
                raise Untrusted(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except Untrusted:
        raise
    except RecursionError:
        raise Untrusted("JSON nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise Untrusted(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise Untrusted(f"not JSON: {str(exc)[:120]}") from None
