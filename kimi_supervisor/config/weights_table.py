"""The two readings of `[weights]` (docs/weight-holder.md): the holder's own table, or an engine's.

Which one a config gets is its role's rule (config/role_spec.py); neither names a role.  The holder's argv is
completed here (socket directory, loopback /health) and the engine's checked against the holder's
(config/weights.py); a `WeightsArgError` is the caller's to turn into the file's ConfigError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kimi_supervisor.config.model import ChildConfig, WeightsConfig
from kimi_supervisor.config.table import Table
from kimi_supervisor.config.vllm_args import parse_vllm_args
from kimi_supervisor.config.weights import (
    DEFAULT_WAIT_S,
    check_engine_argv,
    check_socket_path,
    holder_argv,
    weights_key,
)
from kimi_supervisor.roles import Role

# (the table, whether the file has it, the config's role, the child so far, the deployment's socket directory)
WeightsReader = Callable[[Table, bool, Role, ChildConfig, Path], tuple[WeightsConfig | None, ChildConfig]]


def holder_table(
    t: Table, present: bool, role: Role, child: ChildConfig, sockets: Path
) -> tuple[WeightsConfig | None, ChildConfig]:
    """The holder's: its /health port, its argv completed; the engine's keys refused."""
    for key in ("holder", "wait_s"):
        if t.has(key):
            raise t.error(key, 'is for the engine that maps the weights, not the holder (role = "weights")')
    given = t.raw("health_port", None)
    port = t.integer("health_port", 0, minimum=1, maximum=65535) if given is not None else None
    argv, port, host = holder_argv(child.argv, sockets, port)
    check_socket_path(sockets, argv)
    t.done()
    vllm = dataclasses.replace(parse_vllm_args(argv), host=host, port=port)
    child = dataclasses.replace(child, argv=argv, vllm=vllm)
    return WeightsConfig(sockets, health_port=port, health_host=host, key=weights_key(argv)), child


def _engine_keys(t: Table, present: bool) -> tuple[bool, float]:
    if not present:
        return False, DEFAULT_WAIT_S
    holder = t.boolean("holder", False)
    wait_s = t.number("wait_s", DEFAULT_WAIT_S, maximum=7 * 86400)
    if t.has("health_port"):
        raise t.error("health_port", 'is the holder\'s (its config, role = "weights"); the engine reads it there')
    t.done()
    return holder, wait_s


def engine_table(
    t: Table, present: bool, role: Role, child: ChildConfig, sockets: Path
) -> tuple[WeightsConfig | None, ChildConfig]:
    """An engine's: `holder = true` maps its deployment's holder's weights, its argv checked against them."""
    holder, wait_s = _engine_keys(t, present)
    if not holder:
        return None, child
    check_engine_argv(child.argv, sockets)
    check_socket_path(sockets, child.argv)
    return WeightsConfig(sockets, wait_s=wait_s, key=weights_key(child.argv)), child


def refusing_holder_table(
    t: Table, present: bool, role: Role, child: ChildConfig, sockets: Path
) -> tuple[WeightsConfig | None, ChildConfig]:
    """An engine's keys, but `holder = true` refused: a weight holder serves one host's engine."""
    holder, _ = _engine_keys(t, present)
    if holder:
        raise t.error(
            "holder", f"true, but deployment.role is {role.value!r}: a weight holder serves one host's engine"
        )
    return None, child


def spare_weights(
    t: Table, present: bool, role: Role, child: ChildConfig, sockets: Path
) -> tuple[WeightsConfig | None, ChildConfig]:
    """A hot spare's (docs/spare.md): its engine's held weights, as its argv (its engine's) maps them; its config has
    no [weights] (config/role_spec.py tables)."""
    check_engine_argv(child.argv, sockets)
    return WeightsConfig(sockets, key=weights_key(child.argv)), child
