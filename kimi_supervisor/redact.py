"""Secrets never reach a log line, a report, STATUS= or check-config.

What counts as secret: environment variables whose name has a secret word as one of
its parts (HF_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY; not TOKENIZERS_PARALLELISM),
from `child.env` *and* from the supervisor's own environment; argv options named the
same way (`--api-key X`, `--hf-token=X`, `--ssl-keyfile-password X`); and `NAME=VALUE`
argv items (`env HF_TOKEN=... vllm serve`).  Their values are then removed from free
text too (the child's lines, failure messages), longest first, so a secret that
contains another is never half replaced.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

REDACTED = "<redacted>"
REDACTED_BYTES = REDACTED.encode()
MIN_SECRET_LEN = 4  # shorter values ("1", "yes") would blank out ordinary text

_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "passphrase", "credential", "apikey"})
_SUFFIXES = ("token", "apikey", "accesskey", "privatekey", "secretkey", "secret", "password", "passwd")
# The options vLLM and its launchers take a secret through, whatever the generic rule says.
SECRET_OPTIONS = frozenset({"--api-key", "--hf-token", "--ssl-keyfile-password", "--token", "--password"})
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def is_secret_name(name: str) -> bool:
    """A variable or option name with a secret word as one of its parts ("--max-num-batched-tokens" is not)."""
    parts = [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
    return any(p in _WORDS or p.endswith(_SUFFIXES) for p in parts)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_name(k) else v) for k, v in env.items()}


def redact_argv(argv: Iterable[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-"):
            name, eq, _ = arg.partition("=")
            if name in SECRET_OPTIONS or is_secret_name(name):
                if eq:
                    out.append(f"{name}={REDACTED}")
                else:
                    out.append(arg)
                    hide_next = True
                continue
        else:
            assignment = _ASSIGNMENT.match(arg)
            if assignment and is_secret_name(assignment.group(1)):
                out.append(f"{assignment.group(1)}={REDACTED}")
                continue
        out.append(arg)
    return out


def secrets_in_argv(argv: Iterable[str]) -> list[str]:
    """The options (`--api-key`) and NAME=VALUE items of `argv` that hold a secret: readable in
    /proc/PID/cmdline by every local user, where child.credentials would keep it out (docs/configuration.md)."""
    argv = list(argv)
    found = []
    for i, (real, shown) in enumerate(zip(argv, redact_argv(argv), strict=True)):
        if shown == REDACTED and i > 0:
            found.append(argv[i - 1])
        elif shown.endswith("=" + REDACTED):
            found.append(real.partition("=")[0])
    return found


def secrets_of(argv: Iterable[str], *envs: Mapping[str, str], known: Iterable[str] = ()) -> tuple[str, ...]:
    """The secret values in an argv and environments, and `known` ones (a credential's, whatever the name of
    its variable), longest first (the order redact_text needs)."""
    argv = list(argv)
    values = {v for env in envs for k, v in env.items() if is_secret_name(k)} | set(known)
    for real, shown in zip(argv, redact_argv(argv), strict=True):
        if shown == REDACTED:
            values.add(real)
        elif shown.endswith("=" + REDACTED):
            values.add(real.partition("=")[2])
    return tuple(sorted((v for v in values if len(v) >= MIN_SECRET_LEN), key=lambda v: (-len(v), v)))


def secret_bytes(secrets: Iterable[str]) -> tuple[bytes, ...]:
    encoded = {s.encode("utf-8", "surrogateescape") for s in secrets if len(s) >= MIN_SECRET_LEN}
    return tuple(sorted(encoded, key=lambda b: (-len(b), b)))


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Remove known secret values from free text, longest first (`abcd` must not eat half of `abcdEFGH`)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SECRET_LEN and secret in text:
            text = text.replace(secret, REDACTED)
    return text
