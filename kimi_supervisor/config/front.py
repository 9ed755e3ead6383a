"""The front's settings (docs/front.md): the `[front]` table of a front's config, `NAME.front.toml`.

The engine's socket and state file are not settings: they are where the deployment's engine puts them
(`<runtime>/NAME/front/engine.sock`, `<runtime>/NAME/state.json`), so the two units cannot disagree.
"""

from __future__ import annotations

import dataclasses
import pwd
import re
from pathlib import Path

from kimi_supervisor.config.table import Table
from kimi_supervisor.roles import Role

SOCKET_DIR = "front"  # below the deployment's runtime directory: the engine's socket, reached by the front only
SOCKET_NAME = "engine.sock"
SPARE_SOCKET_NAME = "spare.sock"  # the hot spare's, beside it (docs/spare.md, config/spare.py)
_ROUTE = re.compile(r"^/[A-Za-z0-9_./{}-]*$")


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    deployment: str = "kimi-supervisor"  # its metrics' `deployment` label, as the engine's textfile has it
    host: str = "0.0.0.0"
    port: int = 8000
    # The engine's Unix socket (vLLM's --uds): <runtime>/NAME/front/engine.sock.
    engine_socket: Path = Path("/run/kimi-supervisor/kimi-supervisor/front/engine.sock")
    # The engine supervisor's state file: its phase (stopping: hold new requests) and load ETA (Retry-After).
    engine_state_file: Path | None = None
    # The engine supervisor's history: its last successful load sets hold_s when the config does not.
    engine_history_file: Path | None = None
    # The weight holder's state file (docs/weight-holder.md): an outage ended while it was ready is holder-assisted.
    engine_holder_state_file: Path | None = None
    # Its own state file, which `kimi-supervisor status NAME` shows beside the engine's; None: none written.
    state_file: Path | None = None
    # The file these settings were read from: its state file names it, as the engine's does (`status`' Config).
    config_file: Path | None = None
    queue_max: int = 1024  # requests held at once; the next is answered 503 at once
    # The longest a request waits for the engine, then 503 with Retry-After; None: from the engine's history
    # (deployment/front/records.py hold_bound).
    hold_s: float | None = None
    max_attempts: int = 3  # sends of one request to the engine (the first and the resumes)
    max_body_bytes: int = 32 << 20  # a resumable request's body is kept to be sent again
    # Every kept body together (held while the engine restarts, or in flight): past it 503 with Retry-After.
    max_held_bytes: int = 1 << 30
    allow_routes: tuple[str, ...] = ()  # control routes forwarded all the same (docs/front.md, Routes)
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 2.0
    # The account it serves as once its root-only work is done (docs/front.md, "Who it runs as"); None: the
    # engine's child.user, read from NAME.toml when the front starts.
    user: str | None = None
    # The deployment's hot spare (docs/spare.md), the second engine new requests go to while the engine does not
    # serve: its socket and its supervisor's state file and history, where its role puts them; None: no spare.
    spare_socket: Path | None = None
    spare_state_file: Path | None = None
    spare_history_file: Path | None = None
    # The deployment without a ready spare longer than this: the alert (kimi_front_no_ready_spare_alert).
    spare_alert_s: float = 600.0


def engine_socket(runtime_directory: Path, name: str) -> Path:
    return runtime_directory / name / SOCKET_DIR / SOCKET_NAME


def parse_front(
    t: Table, runtime_directory: Path, state_directory: Path, name: str, config_file: Path | None = None
) -> FrontConfig:
    """[front] of a front's config; ConfigError naming the file and key."""
    host = t.string("host", FrontConfig.host)
    assert host is not None
    allow = t.strings("allow_routes", ())
    for i, route in enumerate(allow):
        if not _ROUTE.match(route):
            raise t.error(f"allow_routes[{i}]", f"expected a path starting with '/', got {route!r}")
    user = t.string("user", None)
    if user is not None:
        try:
            pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except (KeyError, OverflowError):
            raise t.error("user", f"no such user {user!r} on this host") from None
    given_hold = t.has("hold_s")
    hold = t.number("hold_s", 0.0, maximum=86400.0, zero_ok=True)
    spare = t.boolean("spare", False)
    cfg = FrontConfig(
        deployment=name,
        host=host,
        port=t.integer("port", FrontConfig.port, minimum=1, maximum=65535),
        engine_socket=engine_socket(runtime_directory, name),
        # Each where config/layout.py puts its role's (layout imports this module's FrontConfig through model.py).
        engine_state_file=runtime_directory / name / Role.ENGINE.state_file_name,
        engine_history_file=state_directory / name / Role.ENGINE.history_file_name,
        engine_holder_state_file=runtime_directory / name / Role.WEIGHTS.state_file_name,
        state_file=runtime_directory / name / Role.FRONT.state_subdirectory / Role.FRONT.state_file_name,
        config_file=config_file,
        queue_max=t.integer("queue_max", FrontConfig.queue_max, minimum=0, maximum=1 << 20),
        hold_s=hold if given_hold else None,
        max_attempts=t.integer("max_attempts", FrontConfig.max_attempts, minimum=1, maximum=100),
        max_body_bytes=t.integer("max_body_bytes", FrontConfig.max_body_bytes, minimum=1024, maximum=1 << 30),
        max_held_bytes=t.integer("max_held_bytes", FrontConfig.max_held_bytes, minimum=1024, maximum=1 << 40),
        allow_routes=allow,
        probe_interval_s=t.number("probe_interval_s", FrontConfig.probe_interval_s, maximum=60.0),
        probe_timeout_s=t.number("probe_timeout_s", FrontConfig.probe_timeout_s, maximum=60.0),
        user=user,
        spare_socket=runtime_directory / name / SOCKET_DIR / SPARE_SOCKET_NAME if spare else None,
        spare_state_file=runtime_directory / name / Role.SPARE.state_file_name if spare else None,
        spare_history_file=state_directory / name / Role.SPARE.history_file_name if spare else None,
        spare_alert_s=t.number("spare_alert_s", FrontConfig.spare_alert_s, maximum=7 * 86400.0),
    )
    t.done()
    return cfg
