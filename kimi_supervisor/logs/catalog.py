"""MESSAGE_ID of our own lifecycle events in the journal: one 128-bit id per kind of event, journald's catalog
convention (systemd.journal-fields(7); `journalctl MESSAGE_ID=...` finds every occurrence whatever the
message's wording, and `journalctl -x` adds the explanation packaging/journal/kimi-supervisor.catalog holds).

An id, once shipped, never changes and never moves to another event: operators' queries and alerts match on
it. A new kind of event gets a new id (`systemd-id128 new`) and a catalog entry (tests/logs/test_catalog.py
checks both match).
"""

from __future__ import annotations

from kimi_supervisor.states import State

# The state machine's transitions (lifecycle/machine.py logs `state.<state>`), then the run's own ends and the
# two events an operator looks for after a page: a kill by the preflight and a GPU's XID.
MESSAGE_IDS: dict[str, str] = {
    "state.preflight": "298ea69d43cb45519861b01ae3d0520d",
    "state.starting": "dde4df1742d34a22b126b8376af413cc",
    "state.ready": "dc50ecf1e8034ff88decac6ca1d9df73",
    "state.stopping": "2c1739e17e1d4eba9b501f0b2bd506c7",
    "state.stopped": "5a7c023c69b241f289ac23f44e59e03e",
    "state.failed": "49b06cf57cd94514a918e92a19259f85",
    "supervisor.start": "d712952558fa43018f69622b9029851e",
    "supervisor.exit": "484bc0f49c604239989cd15181429c67",
    "supervisor.crash": "828d41077d7a4476a56069711b3c8e08",
    "preflight.kill": "15232627c80447fc9095cf76f88b1140",
    "gpu.xid": "f7805d7b82504a67ae3562e89273be23",
}


def message_id(event: str) -> str | None:
    """The event's MESSAGE_ID, or None for an event that has none (most: only the kinds above)."""
    return MESSAGE_IDS.get(event)


def state_events() -> set[str]:
    """The events of every transition (a State added to states.py without an id above fails the catalog test)."""
    return {f"state.{s.value}" for s in State}
