"""A deployment's role as one object: one room per role, chosen once from the config (choose.py).

base.py: what every deployment answers (its run, its locks, its dry-run checks, its units); supervised.py: what a
supervised child's adds (its run builds the lifecycle's Deps; it answers `lifecycle.deps.RolePart`); engine.py:
the engine, and the engine that maps a weight holder's weights; weights.py: the weight holder; group/: a node of
a multi-node group, with the group's status server, its peer client and its policy; front/: the front, a peer of
the supervised roles (no child, no lifecycle).  The lifecycle asks `RolePart` and never names a role.
"""
