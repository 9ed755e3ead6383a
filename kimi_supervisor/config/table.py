"""Reading one TOML table: typed getters that name the dotted key, then `done()` rejects leftovers.

Every problem is a one-line `ConfigError` naming the file, the key and what was expected instead of what
was found; values from the file are shown short (a quoted key or a string may be 1 MiB).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kimi_supervisor.exitcodes import ConfigError

MISSING = object()


# Shortest accepted interval or timeout: 1e-300 would make a poll loop spin a core.
MIN_SECONDS = 0.01


def describe(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    name = kind.get(type(value), type(value).__name__)
    shown = short_repr(value) if not isinstance(value, (list, dict)) else ""
    return f"{name} {shown}".strip()


def short_repr(value: object, limit: int = 80) -> str:
    if isinstance(value, int) and value.bit_length() > 200:
        return f"<an integer of {value.bit_length()} bits>"  # repr() of a 5000-digit int raises
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def _show_name(name: str) -> str:
    # TOML quoted keys may hold anything (spaces, newlines, 1 MiB): show those quoted and short.
    return name if re.fullmatch(r"[A-Za-z0-9_.\[\]-]{1,80}", name) else short_repr(name, 40)


class Table:
    """One TOML table being read: typed getters, then `done()` rejects leftovers."""

    def __init__(self, raw: Mapping[str, Any], prefix: str, file: Path) -> None:
        self._raw = raw
        self._prefix = prefix
        self._file = file
        self._seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self._prefix}{_show_name(name)}"

    def has(self, name: str) -> bool:
        """Whether the file gives `name` (a key another role's config uses, refused by the caller)."""
        return name in self._raw

    def error(self, name: str, message: str) -> ConfigError:
        return ConfigError(f"{self._file}: {self.key(name)}: {message}")

    def _get(self, name: str, default: object) -> object:
        self._seen.add(name)
        value = self._raw.get(name, MISSING)
        if value is MISSING:
            if default is MISSING:
                raise self.error(name, "required key is missing")
            return default
        return value

    def _typed(self, name: str, default: object, check: Callable[[object], bool], expected: str) -> object:
        value = self._get(name, default)
        if value is not default and not check(value):
            raise self.error(name, f"expected {expected}, got {describe(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        return bool(self._typed(name, default, lambda v: isinstance(v, bool), "true or false"))

    def number(self, name: str, default: float, *, maximum: float = 1e9, zero_ok: bool = False) -> float:
        """Seconds: at least MIN_SECONDS (or exactly 0 where `zero_ok` means "skip"), at most `maximum`."""

        def ok(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        value = float(self._typed(name, default, ok, "a number of seconds" if name.endswith("_s") else "a number"))  # type: ignore[arg-type]
        if not (value == 0 and zero_ok) and not MIN_SECONDS <= value <= maximum:
            bound = f"0 or a value >= {MIN_SECONDS:g}" if zero_ok else f"a value >= {MIN_SECONDS:g}"
            raise self.error(name, f"expected {bound} and <= {maximum:g}, got {value:g}")
        return value

    def integer(self, name: str, default: int, *, minimum: int, maximum: int) -> int:
        value = self._typed(name, default, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
        assert isinstance(value, int)
        if not minimum <= value <= maximum:
            raise self.error(name, f"expected an integer between {minimum} and {maximum}, got {value}")
        return value

    def string(self, name: str, default: object) -> str | None:
        value = self._typed(name, default, lambda v: isinstance(v, str), "a string")
        return value if isinstance(value, str) else None

    def strings(self, name: str, default: object, *, non_empty: bool = False) -> tuple[str, ...]:
        def ok(v: object) -> bool:
            return isinstance(v, list) and all(isinstance(x, str) for x in v)

        value = self._typed(name, default, ok, "an array of strings")
        result = tuple(value) if isinstance(value, (list, tuple)) else ()
        if non_empty and not result:
            raise self.error(name, "expected a non-empty array of strings, got an empty array")
        return result

    def patterns(self, name: str, default: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
        compiled = []
        for text in self.strings(name, list(default)):
            try:
                compiled.append(re.compile(text))
            except re.error as exc:
                raise self.error(name, f"invalid regular expression {text!r}: {exc}") from None
        return tuple(compiled)

    def table(self, name: str) -> Table:
        value = self._typed(name, {}, lambda v: isinstance(v, dict), "a table")
        assert isinstance(value, dict)
        return Table(value, self.key(name) + ".", self._file)

    def raw(self, name: str, default: object) -> object:
        return self._get(name, default)

    def done(self) -> None:
        for name in self._raw:
            if name not in self._seen:
                close = difflib.get_close_matches(name, sorted(self._seen), n=1, cutoff=0.75)
                hint = f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(sorted(self._seen))})"
                raise self.error(name, f"unknown key{hint}")
