"""A deployment's role as one object: one room per role, chosen once from the config (choose.py).

base.py: what every role answers (its run, lock suffix, status port, dry-run checks, unit pair); engine.py: the
engine, and the engine that maps a weight holder's weights; weights.py: the weight holder; group/: a node of a
multi-node group, with the group's status server, its peer client and its policy.  The lifecycle asks
`lifecycle.deps.RolePart` and never names a role.
"""
