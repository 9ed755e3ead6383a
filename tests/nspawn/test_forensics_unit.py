"""An incident's stack dump under the shipped unit's hardening, under a real systemd (nspawn).

A probe service with exactly the shipped unit's [Service] hardening (its SystemCallFilter=~@debug above all)
runs a sleeping Python child and dumps it twice: forensics' way, `py-spy dump --nonblocking`, which reads
memory with process_vm_readv (in @ipc, allowed) and names the function the child sleeps in; and py-spy's
default, which pauses the target with ptrace (in @debug) and is refused: why the unit needs no change
(docs/hardening.md).
"""

from __future__ import annotations

import json

import checkout
from nspawn import NspawnMachine

from kimi_supervisor.opsview import forensics
from kimi_supervisor.systemd import unit

PROBE_UNIT = "kimi-forensics-probe.service"
SCRIPT = "/usr/local/libexec/kimi-forensics-probe.py"
PROBE = """
import json, subprocess, sys
from kimi_supervisor.opsview import forensics
SLEEPER = "import time\\ndef stuck_in_a_known_function():\\n    print('up', flush=True)\\n    time.sleep(600)\\n"
child = subprocess.Popen([sys.executable, "-c", SLEEPER + "stuck_in_a_known_function()"], stdout=subprocess.PIPE)
child.stdout.readline()
found, note = forensics.default_dumper()
ours = found.dump(child.pid, 5.0) if found else (None, note)
paused = subprocess.run([note, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=5)
child.kill()
print("PROBE " + json.dumps({"ours": ours, "paused": [paused.returncode, paused.stderr]}), flush=True)
"""


def probe_unit() -> str:
    """The shipped unit with the probe as its one short-lived process: the same hardening, line for line."""
    lines = []
    for line in unit.render().splitlines():
        if line.startswith("ExecStart="):
            line = f"ExecStart={checkout.PYTHON} {SCRIPT}"
        elif line.startswith("Type="):
            line = "Type=exec"
        elif line.startswith(("WatchdogSec=", "NotifyAccess=", "Restart=")):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_the_dump_reads_a_stack_under_the_shipped_units_filter_without_ptrace(machine: NspawnMachine) -> None:
    if forensics.find_pyspy() is None:
        import pytest

        pytest.skip("py-spy is not installed (the dev and forensics extras install it)")
    m = machine
    checkout.install(m, PROBE_UNIT)
    m.write_file(SCRIPT, PROBE)
    m.install_unit(PROBE_UNIT, probe_unit())
    m.systemctl("start", PROBE_UNIT, timeout=60)
    m.wait_for_property(PROBE_UNIT, "ActiveState", "inactive", timeout=60)
    out = m.journal(PROBE_UNIT, "-o", "cat")
    line = next((x for x in out.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, out[-3000:]
    got = json.loads(line.removeprefix("PROBE "))
    text, error = got["ours"]
    assert error is None and "stuck_in_a_known_function" in text, got
    code, stderr = got["paused"]
    assert code != 0 and "Failed to suspend process" in stderr and "EPERM" in stderr, got  # ptrace: ~@debug
