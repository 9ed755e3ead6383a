"""An engine that maps its deployment's held weights waits for the holder before anything else (docs/weight-holder.md).

Started before the holder is ready, vLLM with `"fallback": false` fails its load; with a fallback it would read
the model from disk beside the held copy and run out of GPU memory.  So the engine's supervisor waits, before
its preflight kills or waits for anything, until the holder's own supervisor says it is ready: its state file
(`<runtime>/<name>/state.weights.json`, written atomically by a live supervisor, so never a lie) in phase
"ready", and the holder's /health (the URL it records) answering 200 now.  Not within `weights.wait_s`: exit
21 with the last reason, nothing killed.

The holder records its cache key (config/weights.py `weights_key`: model, TP, PP, DP, dtype, quantization,
revision) in the same file.  An engine whose flags make another key would have its load refused by the
daemon, so it is refused here, at once, naming each field that differs: exit 10.  So is an engine whose child
runs as another account than the holder's (the uid the holder records, child/socketdir.py): vLLM checks the
sockets' owner and the daemon the peer's uid.  So is an engine whose model on
disk is no longer the checkpoint the holder loaded (the holder's recorded fingerprint, host/checkpoint.py: vLLM's
own, from the shards' headers), naming the shards that changed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from kimi_supervisor.child.spawnplan import Unresolvable, account, resolve_identity
from kimi_supervisor.clock import Clock
from kimi_supervisor.config import layout
from kimi_supervisor.config.model import Config
from kimi_supervisor.config.weights import key_mismatch
from kimi_supervisor.exitcodes import PreflightError, WeightsUnavailable
from kimi_supervisor.host import checkpoint
from kimi_supervisor.host.checkpoint import Fingerprint, changed_shards
from kimi_supervisor.liveness.health_probe import probe
from kimi_supervisor.liveness.http import HttpClient, request
from kimi_supervisor.logs.types import Logger
from kimi_supervisor.opsview.statefile import read_state, writer_alive

PROBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class HolderSeen:
    ready: bool
    why: str  # in words: what the holder is doing, or why it does not count
    doc: dict[str, Any] | None = None


def engine_checkpoint(cfg: Config) -> Fingerprint | None:
    """The engine's model as vLLM will fingerprint it in its load (host/checkpoint.py)."""
    assert cfg.weights is not None
    try:
        return checkpoint.fingerprint(cfg.weights.key.get("model"))
    except checkpoint.CheckpointError as exc:
        why = f"weights: the model cannot be fingerprinted as vLLM will to map the held weights: {exc}"
        raise PreflightError(why) from None


def _refuse_another_account(cfg: Config, weights: dict[str, Any], unit: str) -> None:
    """PreflightError when the engine's child would run as another account than the holder's: vLLM's engine
    accepts only a socket directory and sockets its own uid owns (weight_cache/protocol.py verify_private_dir,
    verify_socket_owner) and the daemon refuses other uids (SO_PEERCRED), after the engine's whole start."""
    held_uid, held_user = weights.get("child_uid"), weights.get("child_user")
    if not isinstance(held_uid, int):
        return  # a holder from before it was recorded
    try:
        user, uid = account(resolve_identity(cfg.child.user, cfg.child.group))
    except Unresolvable:
        return  # the engine's own start fails on it first (exit 78)
    if uid != held_uid:
        raise PreflightError(
            f"weights: the engine's child runs as user {user!r} (uid {uid}) but its weight holder's ({unit}) as "
            f"user {str(held_user)!r} (uid {held_uid}): vLLM maps held weights only between processes of one "
            "account; give both configs the same child.user"
        )


def look(
    cfg: Config,
    http: HttpClient = request,
    alive: Callable[[dict[str, Any]], bool] = writer_alive,
    model_now: Callable[[], Fingerprint | None] | None = None,
) -> HolderSeen:
    """One look at the holder: its state file, its supervisor, its key, its /health.  PreflightError on a key
    that does not match the engine's, or a checkpoint on disk that is not the one the holder loaded.
    `model_now`: the engine's fingerprint (read once per wait, not at every look)."""
    path = layout.holder_of(cfg).state_file
    unit = layout.holder_service(cfg.deployment.name)
    try:
        doc = read_state(path)
    except (OSError, ValueError) as exc:
        return HolderSeen(False, f"the holder's state file is unreadable: {exc}")
    if doc is None:
        return HolderSeen(False, f"no weight holder: {path} does not exist (is {unit} running?)")
    pid = (doc.get("supervisor") or {}).get("pid")
    if not alive(doc):
        return HolderSeen(False, f"the holder's supervisor (PID {pid}) is not running (is {unit} running?)", doc)
    raw = doc.get("weights")
    weights: dict[str, Any] = raw if isinstance(raw, dict) else {}
    held_key = weights.get("key") if isinstance(weights.get("key"), dict) else None
    if held_key is None:
        return HolderSeen(False, f"the holder's state file {path} records no cache key", doc)
    assert cfg.weights is not None
    mismatch = key_mismatch(held_key, dict(cfg.weights.key))
    if mismatch:
        raise PreflightError(
            "weights: the engine's flags do not match its weight holder's cache key ("
            + "; ".join(mismatch)
            + f"): start the holder ({unit}) with the engine's flags, or the engine with the holder's"
        )
    _refuse_another_account(cfg, weights, unit)
    held = weights.get("checkpoint")
    if isinstance(held, dict) and isinstance(held.get("digest"), str):
        now = (model_now or (lambda: engine_checkpoint(cfg)))()
        if now is not None and now.digest != held["digest"]:
            raise PreflightError(
                "weights: the model on disk is not the checkpoint its weight holder loaded ("
                + changed_shards(held, now)
                + f"): vLLM would refuse the held weights; restart {unit} (a full load), then the engine"
            )
    if doc.get("phase") != "ready":
        return HolderSeen(False, f"the holder is {doc.get('phase')}: {doc.get('status') or 'no status'}", doc)
    url = weights.get("health_url")
    if not isinstance(url, str) or not url.startswith("http://"):
        return HolderSeen(False, "the holder's state file records no health URL", doc)
    result = probe(url, PROBE_TIMEOUT_S, http)
    if not result.ok:
        return HolderSeen(False, f"the holder's {url} did not answer 200 ({result.error})", doc)
    return HolderSeen(True, f"ready (supervisor PID {pid}, {url} 200)", doc)


def wait_for_holder(
    cfg: Config,
    clock: Clock,
    log: Logger,
    stopped: Callable[[], bool],
    say: Callable[[str], None],
    http: HttpClient = request,
) -> HolderSeen | None:
    """Until the holder is ready (its HolderSeen), a stop is asked for (None), or `weights.wait_s` passes
    (WeightsUnavailable)."""
    assert cfg.weights is not None
    wait_s, poll_s = cfg.weights.wait_s, cfg.preflight.poll_interval_s
    start = clock.monotonic()
    last_why = ""
    model_now = functools.cache(lambda: engine_checkpoint(cfg))
    while True:
        seen = look(cfg, http, model_now=model_now)
        waited = clock.monotonic() - start
        if seen.ready:
            log.info("weights.holder_ready", waited_s=round(waited, 3), why=seen.why)
            return seen
        if seen.why != last_why:
            log.info("weights.waiting", why=seen.why, waited_s=round(waited, 1), wait_s=wait_s)
            say(f"waiting for the weight holder: {seen.why}"[:400])
            last_why = seen.why
        if waited >= wait_s:
            raise WeightsUnavailable(
                f"the weight holder of deployment {cfg.deployment.name} was not ready within "
                f"{wait_s:g}s (weights.wait_s): {seen.why}; nothing was killed"
            )
        if stopped():
            return None
        clock.sleep(min(poll_s, max(0.0, start + wait_s - clock.monotonic())))
