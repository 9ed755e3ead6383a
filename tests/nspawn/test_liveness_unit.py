"""A wedged engine under the real systemd: the supervisor's own verdict (exit 17), then systemd's restart."""

from __future__ import annotations

from nspawn import NspawnMachine
from unit_setup import UNIT, config, deploy, now, prop

LIVENESS = """[liveness]
canary_interval_s = 0.5
canary_timeout_s = 0.5
failures_tolerated = 2
when = "always"
stuck_after_s = 0
"""


def test_wedged_engine_exits_17_before_the_watchdog_and_systemd_restarts_it(m: NspawnMachine) -> None:
    # /health keeps answering 200: only the canary sees the wedge. WatchdogSec=3 (the drop-in) would fire
    # 3 s after the pings stop; the canary's verdict comes about 1 s after its first failure.
    deploy(m, config(["--load-seconds", "1", "--wedged-after", "1"], extra=LIVENESS))
    since = now(m)
    m.systemctl("start", UNIT, timeout=60)
    m.wait_for(lambda: int(prop(m, "NRestarts")) >= 1, timeout=40, message="no restart after the wedge")
    journal = m.journal(UNIT, "--since", since)
    assert "engine wedged: the 1-token canary completion failed 2 times in a row" in journal
    assert f"{UNIT}: Main process exited, code=exited, status=17/n/a" in journal
    assert "Watchdog timeout" not in journal
    m.systemctl("stop", UNIT)
