"""The one place a role is chosen: from the config, once, at the start of every command."""

from __future__ import annotations

from kimi_supervisor.config.model import Config
from kimi_supervisor.deployment.base import Deployment
from kimi_supervisor.deployment.engine import Engine, HeldWeightsEngine
from kimi_supervisor.deployment.front.role import Front
from kimi_supervisor.deployment.group.member import GroupMember
from kimi_supervisor.deployment.spare import Spare
from kimi_supervisor.deployment.weights import WeightHolder
from kimi_supervisor.roles import Role


def for_config(cfg: Config) -> Deployment:
    if cfg.role is Role.WEIGHTS:
        return WeightHolder(cfg)
    if cfg.role is Role.FRONT:
        return Front(cfg)
    if cfg.role is Role.SPARE:
        return Spare(cfg)
    if cfg.role.in_group:
        return GroupMember(cfg)
    return HeldWeightsEngine(cfg) if cfg.maps_held_weights else Engine(cfg)
