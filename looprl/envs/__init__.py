"""Environments: the protocol (`base.py`), the registry that finds one by name
(`registry.py`), several as one (`mix.py`), the built-ins (`builtin/`), a data file as one
(`data/`) and the ecosystem's adapters (`adapters/`)."""

from __future__ import annotations

from looprl.envs import mix, registry
from looprl.envs.base import (
    Capabilities,
    Environment,
    capabilities,
    demonstrations,
    gives_turn_rewards,
    group_scorer,
    solved_outcomes,
)
from looprl.envs.registry import env_class, env_factory, list_envs, make_env, with_found_files

__all__ = [
    "Capabilities",
    "Environment",
    "capabilities",
    "group_scorer",
    "demonstrations",
    "gives_turn_rewards",
    "env_class",
    "env_factory",
    "list_envs",
    "make_env",
    "solved_outcomes",
    "with_found_files",
]

registry.add_mix(mix.ENVIRONMENTS)
