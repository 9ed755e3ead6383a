"""A node of a multi-node group as a role: the leader or a follower (docs/multi-node.md).

Its run is node.py's (the lifecycle plus the group's status server and peer polls), its status port is locked
with the rest, and its dry run adds the group's checks (checks.py).
"""

from __future__ import annotations

import os

from kimi_supervisor.checks import Check
from kimi_supervisor.deployment.group.checks import group_checks
from kimi_supervisor.deployment.supervised import SupervisedDeployment
from kimi_supervisor.exitcodes import ExitCode
from kimi_supervisor.lifecycle.deps import Deps


class GroupMember(SupervisedDeployment):
    @property
    def status_port(self) -> int | None:
        # A second group deployment on the host refuses (16).
        assert self.cfg.cluster is not None
        return self.cfg.cluster.status_port

    def supervise(self, deps: Deps, secrets: tuple[str, ...]) -> ExitCode:
        from kimi_supervisor.deployment.group.node import run_group_node  # a run's (see supervised.py)

        # Its runs (node.py's, one per group formed) get `deps` as they are: their role part the plain engine's.
        return run_group_node(self.cfg, deps, secrets)

    def dry_run(self, checks: list[Check], gpu_count: int) -> None:
        checks += group_checks(self.cfg, os.environ)  # role, rank, addresses, route, master port, peers
