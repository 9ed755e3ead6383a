"""State machine: only allowed transitions; each logs one event and sends one STATUS=."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kimi_supervisor.lifecycle.machine import InvalidTransition, StateMachine
from kimi_supervisor.states import ALLOWED, State
from testkit.fakes.log import RecordingLog


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, str | int]] = []

    def send(self, **fields: str | int) -> None:
        self.sent.append(fields)


def test_happy_path_logs_and_notifies_once_per_transition() -> None:
    n, log = Recorder(), RecordingLog()
    sm = StateMachine(n, log)
    sm.enter_initial("preflight")
    sm.to(State.STARTING, "starting")
    sm.to(State.READY, "ready: serving", notify={"READY": 1})
    sm.to(State.STOPPING, "stopping", notify={"STOPPING": 1})
    sm.to(State.STOPPED, "stopped")
    assert [e for _, e, _ in log.records] == [
        "state.preflight",
        "state.starting",
        "state.ready",
        "state.stopping",
        "state.stopped",
    ]
    assert n.sent == [
        {"STATUS": "preflight"},
        {"STATUS": "starting"},
        {"READY": 1, "STATUS": "ready: serving"},
        {"STOPPING": 1, "STATUS": "stopping"},
        {"STATUS": "stopped"},
    ]
    assert sm.history == [State.PREFLIGHT, State.STARTING, State.READY, State.STOPPING, State.STOPPED]


@pytest.mark.parametrize(("start", "target"), [(s, t) for s in State for t in State if t not in ALLOWED[s]])
def test_disallowed_transitions_raise(start: State, target: State) -> None:
    sm = StateMachine(Recorder(), RecordingLog())
    sm.state = start
    with pytest.raises(InvalidTransition):
        sm.to(target, "x")


def test_ready_is_reachable_only_from_starting() -> None:
    assert [s for s in State if State.READY in ALLOWED[s]] == [State.STARTING]
    assert ALLOWED[State.STOPPED] == ALLOWED[State.FAILED] == frozenset()


def test_failure_logs_at_error() -> None:
    log = RecordingLog()
    sm = StateMachine(Recorder(), log)
    sm.to(State.FAILED, "failed: x", exit_code=10)
    assert log.records[-1] == (
        "error",
        "state.failed",
        {"previous": "preflight", "status": "failed: x", "exit_code": 10},
    )


def test_the_observer_hears_every_transition_after_systemd_does() -> None:
    n = Recorder()
    heard: list[tuple[State, str, dict[str, object], int]] = []

    class Observer:
        def on_state(self, state: State, headline: str, fields: Mapping[str, Any]) -> None:
            heard.append((state, headline, dict(fields), len(n.sent)))

    sm = StateMachine(n, RecordingLog(), observer=Observer())
    sm.enter_initial("preflight: checking")
    sm.to(State.STARTING, "starting: vLLM spawned", pid=42)
    sm.say("starting: loading weights 1/2 (50%), 3s")  # progress inside a state is not a transition
    sm.to(State.FAILED, "failed: x", exit_code=11)
    assert heard == [
        (State.PREFLIGHT, "preflight: checking", {}, 1),
        (State.STARTING, "starting: vLLM spawned", {"pid": 42}, 2),
        (State.FAILED, "failed: x", {"exit_code": 11}, 4),
    ]
