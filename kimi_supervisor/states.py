"""The lifecycle's states and the transitions allowed between them (the machine: lifecycle/machine.py).

A leaf: the operator's view names a state without importing the lifecycle that moves between them.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    PREFLIGHT = "preflight"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


ALLOWED: dict[State, frozenset[State]] = {
    State.PREFLIGHT: frozenset({State.STARTING, State.STOPPING, State.FAILED}),
    State.STARTING: frozenset({State.READY, State.STOPPING, State.FAILED}),
    State.READY: frozenset({State.STOPPING}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}
