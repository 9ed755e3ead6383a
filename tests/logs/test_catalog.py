"""Our lifecycle events carry a stable MESSAGE_ID in the journal (one 128-bit id per kind of event), and the
catalog file packaging/journal/kimi-supervisor.catalog explains each one, as journalctl reads it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kimi_supervisor.lifecycle.machine import StateMachine
from kimi_supervisor.logs.catalog import MESSAGE_IDS, state_events
from kimi_supervisor.logs.journal import configure, get_logger
from kimi_supervisor.states import State
from kimi_supervisor.systemd.notify import NullNotifier
from testkit.fakes.journal_socket import JournalSocket

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "packaging" / "journal" / "kimi-supervisor.catalog"


def catalog_entries() -> dict[str, str]:
    """id -> Subject, from the catalog file (`-- ID` opens an entry, its header lines follow)."""
    entries, current = {}, None
    for line in CATALOG.read_text().splitlines():
        if m := re.fullmatch(r"-- ([0-9a-f]{32})", line):
            current = m.group(1)
        elif current and line.startswith("Subject: "):
            entries[current] = line.removeprefix("Subject: ")
    return entries


def test_every_state_transition_has_one_id_of_its_own() -> None:
    assert state_events() <= MESSAGE_IDS.keys()
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in MESSAGE_IDS.values())  # 128 bits, as sd_id128 prints
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)


def test_the_state_machines_records_carry_their_message_id(journal: JournalSocket) -> None:
    configure("journal", journal_socket=journal.path, identity={"KIMI_DEPLOYMENT": "kimi-a"})
    machine = StateMachine(NullNotifier(), get_logger())
    machine.enter_initial("preflight: checking GPUs")
    machine.to(State.STARTING, "starting: loading weights")
    machine.to(State.READY, "ready: serving")
    get_logger().info("preflight.passed", checks=5)  # not a lifecycle event: no id
    records = journal.records()
    assert [(r["KIMI_EVENT"], r.get("MESSAGE_ID")) for r in records] == [
        ("state.preflight", MESSAGE_IDS["state.preflight"]),
        ("state.starting", MESSAGE_IDS["state.starting"]),
        ("state.ready", MESSAGE_IDS["state.ready"]),
        ("preflight.passed", None),
    ]


def test_the_catalog_explains_every_id_and_no_other() -> None:
    entries = catalog_entries()
    assert sorted(entries) == sorted(MESSAGE_IDS.values())
    assert all(subject.strip() for subject in entries.values())
    # Its @FIELD@ placeholders are fields our records have (KIMI_ plus the key, as logs/journal.py names them).
    for field in set(re.findall(r"@([A-Z_]+)@", CATALOG.read_text())) - {"FIELD"}:
        assert field.startswith("KIMI_"), field


@pytest.mark.skipif(shutil.which("journalctl") is None, reason="no journalctl")
def test_journalctl_reads_the_catalog(tmp_path: Path) -> None:
    """systemd's own parser (`journalctl --update-catalog` under a --root of the test's) lists every id."""
    catalogs = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    catalogs.mkdir(parents=True)
    shutil.copy(CATALOG, catalogs)
    subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"], check=True, timeout=60)
    listed = subprocess.run(
        ["journalctl", f"--root={tmp_path}", "--list-catalog"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert {line.split()[0] for line in listed.splitlines()} == set(MESSAGE_IDS.values())
