"""One real-vLLM scenario under the real systemd of the nspawn tier, with the shipped (hardened) unit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kimi_supervisor.systemd import unit
from testkit.vllm_serve import KV_CACHE_ARGS, VENV
from tests.nspawn import checkout
from tests.nspawn.nspawn import NspawnMachine, available

UNIT = unit.UNIT_NAME
CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"


def test_real_vllm_under_systemd(vllm_bin: Path, tiny_model: Path) -> None:
    ok, why = available()
    if not ok and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"nspawn unavailable: {why} (run .ci/install-systemd-tier.sh)")
    if not ok:
        pytest.skip(why)
    argv = [
        str(vllm_bin),
        "serve",
        str(tiny_model),
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        *KV_CACHE_ARGS,
    ]
    cfg = "\n".join(
        [
            "[child]",
            "argv = [" + ", ".join(f'"{a}"' for a in argv) + "]",
            'env = { HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", VLLM_HOST_IP = "127.0.0.1" }',
            "[preflight]",
            "gpus = []",
            "[readiness]",
            "deadline_s = 300",
            "stall_timeout_s = 120",
            "[health]",
            "interval_s = 2",
            "[shutdown]",
            "grace_s = 20",
            "",
        ]
    )
    extra = [str(VENV), str(tiny_model)]
    with NspawnMachine(binds_ro=[*checkout.binds_ro(), *extra]) as m:
        m.write_file(CONFIG, cfg)
        # This checkout's code, wherever it is cloned (the unit's PrivateTmp hides /tmp).
        m.install_unit(UNIT, unit.render(checkout.install(m, UNIT, extra), Path(CONFIG)))
        start = time.monotonic()
        m.systemctl("start", UNIT, timeout=300)
        took = time.monotonic() - start
        assert m.unit_property(UNIT, "ActiveState") == "active"
        assert m.unit_property(UNIT, "StatusText").startswith("ready: serving on http://127.0.0.1:8000")
        health = m.run(
            [
                "python3",
                "-c",
                "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/health', timeout=5).status)",
            ],
            check=False,
        )
        assert health.stdout.strip() == "200", health.stderr
        events = [e.get("KIMI_EVENT") for e in m.journal_json(UNIT) if e.get("KIMI_EVENT")]
        assert "state.ready" in events
        workers = [e for e in m.journal_json(UNIT) if e.get("VLLM_COMPONENT") in ("Worker", "EngineCore")]
        assert workers, "vLLM's process prefixes did not reach the journal as fields"
        m.systemctl("stop", UNIT, timeout=60)
        assert m.unit_property(UNIT, "ActiveState") == "inactive"
        assert m.unit_property(UNIT, "ExecMainStatus") == "0"
        journal = m.journal(UNIT)
        assert "stop.tree_gone" in journal
        assert took < 300
