"""Client and child output under the real systemd: a hostile request path, and a chatty child (200k lines/s
for 10 s after READY, see flood_scenario.py).

Before the meter, journald's per-unit rate limit dropped the supervisor's own records (5 of 6 lifecycle
records, once even state.ready) and WATCHDOG=1 came 1.7 s late; before the line kinds, one request for
`/EngineDeadError` restarted the service.
"""

from __future__ import annotations

import sys
import time

from flood_scenario import run_flood
from nspawn import NspawnMachine
from unit_setup import UNIT, config, deploy


def test_chatty_child_keeps_every_supervisor_record_and_the_watchdog_on_time(m: NspawnMachine) -> None:
    r = run_flood(m, lines=2_000_000, rate=200_000)
    assert r.missing == [], r
    assert r.restarts == 0
    assert r.suppressed > 0 and r.journal_child_lines > 0
    assert r.journal_child_lines + r.suppressed + r.dropped >= r.lines * 0.99  # the rest: a summary in flight
    assert r.journald_suppressed == 0  # journald itself dropped nothing of ours
    assert len(r.watchdog_gaps) >= 8
    # The defect this guards made pings 1.7 s late (journald's socket full, the loop blocked in a write): with pings
    # every WatchdogSec/2 = 1 s that is 2.7 s of silence, past WatchdogSec, and systemd's own watchdog restarts the
    # unit, which `restarts == 0` above rules out.  The lateness is a number, not a verdict (was `< WatchdogSec/4`,
    # a busy host's scheduling delay): bench row 8 reports it.
    print("flood watchdog worst_lateness_s", round(r.worst_lateness_s, 3), "gaps", r.watchdog_gaps)


def test_hostile_request_paths_do_not_restart_the_unit(m: NspawnMachine) -> None:
    fake_args = ["--tensor-parallel-size", "1", "--shards", "2", "--load-seconds", "1"]
    deploy(m, config(fake_args, health="interval_s = 0.3"))
    m.systemctl("start", UNIT, timeout=60)
    main = m.unit_main(UNIT)  # PID and exec time: a restart may get the same PID back
    get = (
        "import sys, urllib.request, urllib.error\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        urllib.request.urlopen('http://127.0.0.1:8000' + path, timeout=5)\n"
        "    except urllib.error.HTTPError as e:\n"
        "        print(e.code)\n"
    )
    paths = ["/EngineDeadError", "/Worker%20proc%20died%20unexpectedly", "/Application%20startup%20complete."]
    assert m.run([sys.executable, "-c", get, *paths]).stdout.split() == ["404", "404", "404"]
    time.sleep(3)  # several probes and watchdog periods later
    assert m.unit_property(UNIT, "ActiveState") == "active"
    assert m.unit_main(UNIT) == main and m.unit_property(UNIT, "NRestarts") == "0"
    assert 'GET /EngineDeadError HTTP/1.1" 404' in m.journal(UNIT, "--since", "-1min")
    m.systemctl("stop", UNIT, timeout=30)
    assert m.unit_property(UNIT, "ExecMainStatus") == "0"
