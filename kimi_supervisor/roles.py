"""What this supervisor's child is in its deployment: the one word every phase branches on.

A leaf, like states.py: the config names a role, and the preflight, the spawn plan, readiness, liveness, the
instance lock and the operator's view each ask the role what they must do, without importing one another.

One name, one meaning: "role" is only ever this.  A deployment is one model served on one host's GPUs (one
`[deployment] name`); a multi-node group is one deployment spread over `[cluster] nnodes` hosts, one leader
and the rest followers; a weight holder belongs to the engine of the same deployment on the same host.
"""

from __future__ import annotations

import enum


class Role(enum.Enum):
    # One host: `vllm serve`, the API on its port, ready when /health answers.  The default.
    ENGINE = "engine"
    # Node 0 of a multi-node group: `vllm serve --node-rank 0`; serves the API once every follower has joined.
    LEADER = "leader"
    # Node R > 0: `vllm serve --node-rank R --headless`; no API of its own, useful only while its leader serves.
    FOLLOWER = "follower"
    # `vllm preload`: one process per GPU holding the weights, mapped by the engine of the same deployment
    # (`--load-format ipc_cache`) so that an engine restart does not read 540 GB again.
    WEIGHTS = "weights"
    # The deployment's front (docs/front.md): owns the public port, forwards to its engine's --uds socket, holds
    # and resumes requests across the engine's restarts.  No child, no GPU.
    FRONT = "front"
    # The deployment's hot spare (docs/spare.md): a second `vllm serve` on the engine's GPUs, mapping the same held
    # weights, its argv derived from the engine's config (only its --uds socket and its memory flags differ), its
    # own small KV cache; the front sends requests to it while the engine does not serve.
    SPARE = "spare"

    @property
    def in_group(self) -> bool:
        """One node of a multi-node group (it needs `[cluster]`)."""
        return self in (Role.LEADER, Role.FOLLOWER)

    @property
    def file_suffix(self) -> str:
        """Added to its state and history file names: the holder, the front and the spare are further supervisors of
        the same deployment on one host; the others keep the names they had before they existed."""
        return {Role.WEIGHTS: ".weights", Role.FRONT: ".front", Role.SPARE: ".spare"}.get(self, "")

    def config_name(self, name: str) -> str:
        """Its config file's name in deployment `name`: the engine's NAME.toml, beside it NAME.weights.toml,
        NAME.front.toml and NAME.spare.toml (each role's unit runs the one of its instance's name)."""
        return f"{name}{self.file_suffix}.toml"

    @property
    def state_file_name(self) -> str:
        """Its live state file's name (config/layout.py: in the deployment's runtime directory)."""
        return f"state{self.file_suffix}.json"

    @property
    def history_file_name(self) -> str:
        """Its run history's name (config/layout.py: in the deployment's state directory)."""
        return f"history{self.file_suffix}.json"

    @property
    def state_subdirectory(self) -> str:
        """Below the deployment's runtime directory, where its state file is: the front's own directory (it
        writes there after it drops root, docs/front.md "Who it runs as"); the others write beside the engine."""
        return {Role.FRONT: "front-state"}.get(self, "")

    @property
    def beside_engine(self) -> bool:
        """A second supervisor of its engine's deployment (the weight holder, the front): `status` shows its files
        beside the engine's, never as the deployment (NAME.front.toml and NAME.weights.toml name deployment NAME)."""
        return self in (Role.WEIGHTS, Role.FRONT)

    @property
    def serves_api(self) -> bool:
        """Its child answers the OpenAI API (and /health) on child.vllm's port."""
        return self in (Role.ENGINE, Role.LEADER, Role.SPARE)


ROLE_NAMES = tuple(r.value for r in Role)
