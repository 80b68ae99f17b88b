"""Environment registry: built-ins by name, the ecosystem adapters by `prefix:target`
(`reasoning-gym:<dataset>`, `verifiers:<module[:Class]>`), user classes by
`package.module:Class` (imported only when named explicitly), and installed plugins through
the `looprl.envs` entry-point group."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from looprl.envs.base import Environment, demonstrations, gives_turn_rewards, solved_outcomes
from looprl.envs.common import import_attribute
from looprl.errors import EnvError

__all__ = [
    "Environment",
    "demonstrations",
    "gives_turn_rewards",
    "env_class",
    "env_factory",
    "list_envs",
    "make_env",
    "solved_outcomes",
]


_BUILTIN_MODULES = (
    "builtin.tictactoe", "builtin.extraction", "builtin.workflow", "builtin.instructions",
    "data.dataset", "mix", "adapters.mcp_env",
)  # fmt: skip
# `prefix:target` names: an adapter class whose `bind(target)` gives the environment class
# (envs/common.py `Adapter`); its third-party library is imported only when it is used
_ADAPTERS = {
    "reasoning-gym": "adapters.reasoning_gym_env:ReasoningGym",
    "verifiers": "adapters.verifiers_env:Verifiers",
}


def _builtins() -> dict[str, type]:
    out: dict[str, type] = {}
    for module in _BUILTIN_MODULES:
        out.update(importlib.import_module(f"looprl.envs.{module}").ENVIRONMENTS)
    return out


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="looprl.envs")}


def list_envs() -> dict[str, str]:
    """Name → one-line description of every built-in and installed environment."""
    out = {name: cls.description for name, cls in _builtins().items()}
    for prefix in _ADAPTERS:
        cls = _adapter(prefix)
        out[f"{prefix}:{cls.target_help}"] = cls.description
    for name, ep in _plugins().items():
        try:
            out.setdefault(name, getattr(ep.load(), "description", ""))
        except Exception as err:  # a broken plugin must not hide the others
            out.setdefault(name, f"(failed to load: {err})")
    return out


def env_class(name: str) -> type:
    """The environment class registered as `name`, or loaded from `package.module:Class`."""
    builtins = _builtins()
    if name in builtins:
        return builtins[name]
    plugins = _plugins()
    if name in plugins:
        return plugins[name].load()
    prefix, _, target = name.partition(":")
    if prefix in _ADAPTERS:
        return _adapter(prefix).bind(target)
    if ":" in name:
        return _import_class(name)
    known = ", ".join(sorted(set(builtins) | set(plugins)))
    raise EnvError(
        f"unknown environment {name!r}; known: {known} (or 'package.module:Class' for your own)"
    )


def _adapter(prefix: str) -> Any:
    module, _, attr = _ADAPTERS[prefix].partition(":")
    return getattr(importlib.import_module(f"looprl.envs.{module}"), attr)


def make_env(name: str, args: dict[str, Any] | None = None) -> Any:
    """A fresh environment instance (one per episode)."""
    return env_factory(name, args)()


def env_factory(name: str, args: dict[str, Any] | None = None) -> Callable[[], Any]:
    """`make_env` with the class looked up once: each call returns a fresh instance. A
    rollout makes one env per episode, and looking a name up scans the installed
    packages' entry points (a few ms each time)."""
    cls = env_class(name)

    def make() -> Any:
        try:
            return cls(**(args or {}))
        except EnvError:
            raise
        except TypeError as err:
            raise EnvError(f"bad env.args for {name!r}: {err}") from None

    return make


def _import_class(spec: str) -> type:
    cls = import_attribute(spec, "environment")
    # An agent environment (looprl.agents) has `run_agent` instead of `reset` and `step`.
    needed = ("tasks", "run_agent") if hasattr(cls, "run_agent") else ("tasks", "reset", "step")
    missing = [m for m in needed if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"{spec} is not an environment: it lacks {', '.join(missing)}")
    return cls
