"""A chatty child under the real systemd: 200k lines/s for 10 s after READY (see flood_scenario.py).

Before the meter, journald's per-unit rate limit dropped the supervisor's own records (5 of 6 lifecycle
records, once even state.ready) and WATCHDOG=1 came 1.7 s late.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flood_scenario import WATCHDOG_S, install, run_flood
from nspawn import NspawnMachine


@pytest.fixture(scope="module")
def m(machine: NspawnMachine) -> Iterator[NspawnMachine]:
    install(machine)
    machine.daemon_reload()
    yield machine


def test_chatty_child_keeps_every_supervisor_record_and_the_watchdog_on_time(m: NspawnMachine) -> None:
    r = run_flood(m, lines=2_000_000, rate=200_000)
    assert r.missing == [], r
    assert r.restarts == 0
    assert r.suppressed > 0 and r.journal_child_lines > 0
    assert r.journal_child_lines + r.suppressed + r.dropped >= r.lines * 0.99  # the rest: a summary in flight
    assert r.journald_suppressed == 0  # journald itself dropped nothing of ours
    assert len(r.watchdog_gaps) >= 8
    assert max(r.watchdog_gaps) <= WATCHDOG_S / 2 + 0.1 * WATCHDOG_S, r.watchdog_gaps
