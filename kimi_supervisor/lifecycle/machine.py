"""The lifecycle as an explicit state machine.

    preflight -> starting -> ready -> stopping -> stopped
        \\-----------\\----------\\---------\\-> failed (via stopping when a child exists)

Each transition logs one event (`state.<name>`), sends one STATUS= and tells
the observer (the operator's view: state file, history, metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kimi_supervisor.logs.types import Logger
from kimi_supervisor.states import ALLOWED, State
from kimi_supervisor.systemd.notify import Notifier


class InvalidTransition(RuntimeError):
    pass


class StateObserver(Protocol):
    def on_state(self, state: State, headline: str, fields: Mapping[str, Any]) -> None: ...


class StateMachine:
    def __init__(self, notifier: Notifier, log: Logger, observer: StateObserver | None = None) -> None:
        self.state = State.PREFLIGHT
        self._notifier = notifier
        self._log = log
        self._observer = observer
        self.history: list[State] = [State.PREFLIGHT]

    def enter_initial(self, headline: str) -> None:
        self._log.info("state.preflight", status=headline)
        self._notifier.send(STATUS=headline)
        if self._observer is not None:
            self._observer.on_state(State.PREFLIGHT, headline, {})

    def to(self, new: State, headline: str, notify: Mapping[str, str | int] | None = None, **fields: Any) -> None:
        """Move to `new`: one event, one datagram (STATUS= plus e.g. READY=1 together)."""
        if new not in ALLOWED[self.state]:
            raise InvalidTransition(f"{self.state.value} -> {new.value} is not an allowed transition")
        previous, self.state = self.state, new
        self.history.append(new)
        level = self._log.error if new is State.FAILED else self._log.info
        level(f"state.{new.value}", previous=previous.value, status=headline, **fields)
        self._notifier.send(**(dict(notify) if notify else {}), STATUS=headline)
        if self._observer is not None:
            self._observer.on_state(new, headline, fields)

    def say(self, text: str) -> None:
        """A progress update inside a state: STATUS= only, no transition."""
        self._notifier.send(STATUS=text)
