"""Which of vLLM 0.32's routes the front forwards, and how (docs/front.md, Routes).

An allow-list, not a deny-list: a route a later vLLM adds is refused until someone decides it is public.
"""

from __future__ import annotations

import enum
import re


class Route(enum.Enum):
    """How the front treats a path."""

    FORWARD = "forward"  # held while the engine is not serving; 502 if the engine breaks under it
    RESUMABLE = "resumable"  # held, and sent again or resumed when a restart breaks it
    PROBE = "probe"  # the engine's own view of itself (/health, /metrics): at once, never held
    FRONT = "front"  # the front's own /front/health and /front/metrics
    REFUSED = "refused"  # a control route, or a path the front will not pass on


# path -> the request's format ("chat" or "completion"), the two the token-in route can continue.
RESUMABLE = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
PROBES = frozenset({"/health", "/metrics"})
FRONT_OWN = frozenset({"/front/health", "/front/metrics"})
PUBLIC = frozenset(
    {
        "/ping",
        "/version",
        "/load",
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/v2/rerank",
        "/invocations",
        "/openapi.json",
    }
)
# Under /v1/ but not for clients: adapters change what every client gets; render/derender need
# --enable-scale-out, which the front turns on for itself only.
_V1_REFUSED = re.compile(r"^/v1/((un)?load_lora_adapter|.*/(de)?render)$")
# Paths the engine's router would not resolve as written: refused rather than guessed at.
_ODD = re.compile(r"//|/\.\.?(/|$)|%")


def route_of(raw_path: str, allow: tuple[str, ...] = ()) -> Route:
    """`raw_path` as the client sent it (percent-escapes included), without the query."""
    if _ODD.search(raw_path):
        return Route.REFUSED
    if raw_path in FRONT_OWN:
        return Route.FRONT
    if raw_path in PROBES:
        return Route.PROBE
    if raw_path in RESUMABLE:
        return Route.RESUMABLE
    if raw_path in allow or raw_path in PUBLIC:
        return Route.FORWARD
    if raw_path.startswith("/v1/") and not _V1_REFUSED.match(raw_path):
        return Route.FORWARD
    return Route.REFUSED
