"""Each role's rules, as data: what its config must, may and must not say, the defaults it gets, and the few
facts about its child that the layers below deployment/ need.

A role is one object (kimi_supervisor/deployment/), but that object is chosen from a parsed config, and the
config, the preflight and the operator's view run without one (a dry run, check-config, gpuaccept, a refused
start's record).  So the rules they apply are written here, once per role, as plain values and readers, and
config/load.py, preflight/run.py and opsview/view.py look them up (`of`) and apply them without naming a role.
The table lives in the config layer, not in the roles.py leaf, because its values are config's own (tables,
keys, readiness and liveness defaults, the `[weights]` readers).  It holds this table and nothing else, with no
branch of its own (tests/test_role_branches.py checks both that and the role branches left elsewhere).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from kimi_supervisor.config.model import ReadinessConfig
from kimi_supervisor.config.weights import READY_PATTERN
from kimi_supervisor.config.weights_table import (
    WeightsReader,
    engine_table,
    holder_table,
    refusing_holder_table,
    spare_weights,
)
from kimi_supervisor.roles import Role

# The top-level tables of a config (config/load.py reads each): those every role's config may have, and those of
# a supervised child (its spawn, its checks, its stop, its textfile, its group and its weights).
SHARED_TABLES = frozenset({"deployment", "paths"})
CHILD_TABLES = frozenset(
    {
        "child",
        "preflight",
        "readiness",
        "health",
        "shutdown",
        "metrics",
        "liveness",
        "gpu_health",
        "cluster",
        "readahead",
        "weights",
    }
)
TABLES = SHARED_TABLES | CHILD_TABLES | {"front", "spare"}


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    # [cluster]: the node ranks it may take (the table required), and how its error says so; None: one host, the
    # table refused (docs/multi-node.md).
    node_ranks: tuple[int, int] | None
    node_ranks_text: str
    # How its [weights] table is read (config/weights_table.py).
    read_weights: WeightsReader
    # Which of its deployment's NCCL RAS ports its child takes (config/gpu_pinning.py ras_port_of): 0 the engine's,
    # 1 the holder's beside it on the same GPUs, 2 the spare's.
    ras_slot: int = 0
    # Set when the file leaves the key out: readiness's from the parsed [readiness], liveness's as they are.
    readiness_defaults: Mapping[str, Callable[[ReadinessConfig], Any]] = dataclasses.field(default_factory=dict)
    liveness_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Its child listens on child.vllm's port, which the preflight checks is free: the API, or the holder's /health
    # (taken, vLLM's health thread dies while its READY line still comes, preflight/run.py).  A headless
    # follower opens none.
    opens_port: bool = True
    # Which side of the holder/engine pair its state file's `weights` document is (docs/weight-holder.md); the
    # holder's also records the checkpoint it loads, which its engines compare before they start.
    weights_side: str = "engine"
    records_checkpoint: bool = False
    # It spawns a child (`[child]` required) and may hold GPUs; a front does neither: its [child] is refused and
    # its preflight GPUs are none.
    has_child: bool = True
    # Its config's `[front]` table (config/front.py): required for a front, refused elsewhere.
    reads_front: bool = False
    # Its systemd template, `TEMPLATE@NAME` (config/layout.py); None: the engine's own units.
    unit_template: str | None = None
    # The top-level tables its config may have; another of TABLES is refused, naming it (config/load.py), where
    # it would otherwise be read and mean nothing.  [child], [front] and [cluster] have rules of their own above
    # (has_child, reads_front, node_ranks), which refuse them first in their own words: a supervised role's row
    # lists [cluster] for node_ranks to judge.
    tables: frozenset[str] = SHARED_TABLES | CHILD_TABLES
    # Its child is its engine's (NAME.toml beside it), only its socket and memory flags its own: a hot spare
    # (config/spare.py); its [spare] table is read, its [child] refused.
    child_of_engine: bool = False
    # A spare may stand in for it (config/spare.py check_engine): a one-host engine.
    takes_spare: bool = False
    # When it maps held weights: the other supervisors of its deployment whose GPU memory is its own, by role file
    # suffix (never busy, not waited for at its stop; preflight/run.py partner_memory): the engine's, the holder's
    # and the spare's are each other's (docs/spare.md).  The holder's own start counts none: its engine and spare
    # are bound to it (BindsTo=), so nothing of theirs runs when it loads.
    memory_partners: tuple[str, ...] = ()


# The holder has no OpenAI API: no canary, no token progress to watch; ready on vLLM's READY line and /health.
# vLLM's daemon ranks never set its logging up (weight_cache/daemon.py:476-501, no configure_logging), so the
# holder prints nothing from its launch line to READY, a full load: only the deadline bounds it.
_HOLDER = RoleSpec(
    node_ranks=None,
    node_ranks_text="",
    read_weights=holder_table,
    ras_slot=1,
    readiness_defaults={
        "started_patterns": lambda _: (re.compile(READY_PATTERN),),
        "stall_timeout_s": lambda readiness: readiness.deadline_s,
    },
    liveness_defaults={"canary_interval_s": 0.0, "stuck_after_s": 0.0},
    weights_side="holder",
    records_checkpoint=True,
    unit_template="kimi-supervisor-weights",
)

# The hot spare (docs/spare.md): an engine in all but its config (its argv is its engine's) and its memory, which is
# its own small KV cache beside the engine's on the same GPUs; the engine's and the holder's memory is its own.
_SPARE = RoleSpec(
    node_ranks=None,
    node_ranks_text="",
    read_weights=spare_weights,
    ras_slot=2,
    opens_port=False,  # on its --uds socket, always (config/spare.py check_engine)
    unit_template="kimi-supervisor-spare",
    tables=SHARED_TABLES
    | frozenset({"spare", "preflight", "readiness", "health", "shutdown", "metrics", "liveness", "gpu_health"}),
    child_of_engine=True,
    memory_partners=(Role.ENGINE.file_suffix, Role.WEIGHTS.file_suffix),
)

SPECS: Mapping[Role, RoleSpec] = {
    Role.ENGINE: RoleSpec(
        node_ranks=None,
        node_ranks_text="",
        read_weights=engine_table,
        takes_spare=True,
        memory_partners=(Role.WEIGHTS.file_suffix, Role.SPARE.file_suffix),
    ),
    # Node 0 is the leader by vLLM's --node-rank; the follower's readiness and shutdown defaults follow from its
    # rank too (config/cluster.py), since they need its leader's status URL.
    Role.LEADER: RoleSpec(node_ranks=(0, 0), node_ranks_text="0 (the leader)", read_weights=refusing_holder_table),
    Role.FOLLOWER: RoleSpec(
        node_ranks=(1, 1023),
        node_ranks_text="1 or more (a follower)",
        read_weights=refusing_holder_table,
        opens_port=False,
    ),
    Role.WEIGHTS: _HOLDER,
    Role.SPARE: _SPARE,
    Role.FRONT: RoleSpec(
        node_ranks=None,
        node_ranks_text="",
        read_weights=refusing_holder_table,
        opens_port=False,  # it binds its port itself, in its run: no child's port to check before a spawn
        has_child=False,
        reads_front=True,
        unit_template="kimi-supervisor-front",
        # No child: its checks, stop, textfile (its own metrics are at /front/metrics), group and weights are its
        # engine's config's (docs/front.md).
        tables=SHARED_TABLES | {"front"},
    ),
}


def of(role: Role) -> RoleSpec:
    return SPECS[role]
