"""child.credentials under the real systemd 252: the unit install-unit renders loads the credential
(LoadCredential=), the supervisor reads it from $CREDENTIALS_DIRECTORY and only the child's environment has
it; the journal never does.  Also the lifecycle records' MESSAGE_ID as journald stores them."""

from __future__ import annotations

from pathlib import Path

from nspawn import NspawnMachine
from unit_setup import CONFIG, UNIT, config, deploy, install, prop

from kimi_supervisor.logs.catalog import MESSAGE_IDS
from kimi_supervisor.systemd import unit

KEY = "sk-live-credential-0123456789"
CREDENTIAL = "kimi-api-key"


def environ(m: NspawnMachine, pid: int) -> dict[str, str]:
    raw = m.run(["cat", f"/proc/{pid}/environ"], check=False).stdout.split("\0")
    return dict(item.partition("=")[::2] for item in raw if item)


def test_the_credential_reaches_the_child_only(m: NspawnMachine) -> None:
    launcher = install(m)
    m.install_unit(UNIT, unit.render(launcher, Path(CONFIG), credentials=[CREDENTIAL]))
    m.write_file(f"/etc/credstore/{CREDENTIAL}", KEY + "\n", mode=0o600)
    text = config(["--print-env", "VLLM_API_KEY"])
    deploy(m, text.replace("[child]\n", f'[child]\ncredentials = {{ VLLM_API_KEY = "{CREDENTIAL}" }}\n', 1))
    try:
        m.systemctl("start", UNIT)  # Type=notify: returns once READY=1
        assert prop(m, "ActiveState") == "active"
        main = int(prop(m, "MainPID"))
        envs = {pid: environ(m, pid) for pid in m.unit_pids(UNIT)}
        holders = [pid for pid, env in envs.items() if env.get("VLLM_API_KEY") == KEY]
        assert holders and main not in holders, envs.keys()  # the child's tree has it, the supervisor's own env not
        assert all("CREDENTIALS_DIRECTORY" not in envs[pid] for pid in holders)
        for pid in envs:
            assert KEY not in m.run(["cat", f"/proc/{pid}/cmdline"], check=False).stdout
        m.wait_for(
            lambda: "fake-vllm env VLLM_API_KEY=<redacted>" in m.journal(UNIT),
            timeout=30,
            message="the child's line printing the key",
        )
        records = m.journal_json(UNIT)
        assert KEY not in m.journal(UNIT, "-o", "verbose")
        ready = [r for r in records if r.get("KIMI_EVENT") == "state.ready"]
        assert ready and all(r.get("MESSAGE_ID") == MESSAGE_IDS["state.ready"] for r in ready)
    finally:
        m.systemctl("stop", UNIT, check=False)
        m.run(["rm", "-f", f"/etc/credstore/{CREDENTIAL}"], check=False)
        install(m)  # the module's plain unit again
