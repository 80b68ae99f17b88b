"""Environment registry: built-ins by name, the ecosystem adapters by `prefix:target`
(`reasoning-gym:<dataset>`, `verifiers:<module[:Class]>`), user classes by
`package.module:Class` (imported only when named explicitly), and installed plugins through
the `looprl.envs` entry-point group. The package `looprl.envs` re-exports it."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from looprl.envs.common import import_attribute
from looprl.envs.data.data_files import find_file
from looprl.errors import EnvError

# `mix` makes its members through this registry (envs/mix.py imports it), so the package
# `__init__` adds it here with `add_mix`: importing mix.py from this module would close a
# circle. It keeps its place in `looprl envs`'s list, after `dataset`.
_MIX: dict[str, type] = {}


def add_mix(environments: dict[str, type]) -> None:
    _MIX.update(environments)


def _builtins() -> dict[str, type]:
    # imported on the first lookup, not with the package
    from looprl.envs.adapters import mcp_env
    from looprl.envs.builtin import extraction, instructions, tictactoe, workflow
    from looprl.envs.data import dataset

    return {
        **tictactoe.ENVIRONMENTS,
        **extraction.ENVIRONMENTS,
        **workflow.ENVIRONMENTS,
        **instructions.ENVIRONMENTS,
        **dataset.ENVIRONMENTS,
        **_MIX,
        **mcp_env.ENVIRONMENTS,
    }


# `prefix:target` names: an adapter class whose `bind(target)` gives the environment class
# (envs/common.py `Adapter`); its third-party library is imported only when it is used
ADAPTER_PREFIXES = ("reasoning-gym", "verifiers")


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="looprl.envs")}


def list_envs() -> dict[str, str]:
    """Name → one-line description of every built-in and installed environment."""
    out = {name: cls.description for name, cls in _builtins().items()}
    for prefix in ADAPTER_PREFIXES:
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
    if prefix in ADAPTER_PREFIXES:
        return _adapter(prefix).bind(target)
    if ":" in name:
        return _import_class(name)
    names = sorted(set(builtins) | set(plugins))
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise EnvError(
        f"unknown environment {name!r}; {hint}known: {', '.join(names)} (or "
        "'package.module:Class' for your own)"
    )


def _adapter(prefix: str) -> Any:
    if prefix == "reasoning-gym":
        from looprl.envs.adapters.reasoning_gym_env import ReasoningGym

        return ReasoningGym
    from looprl.envs.adapters.verifiers_env import Verifiers

    return Verifiers


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


def with_found_files(name: str, args: dict[str, Any], base: Path | None) -> dict[str, Any]:
    """`args` with each file they name (the class's `path_args`; a mix's members' too) as an
    absolute path, found in `base` (a config file's folder) or the current folder
    (`find_file`): saved with a run, the config then loads from anywhere."""
    if name == "mix" and isinstance(args.get("members"), list):
        members = [
            {**m, "args": with_found_files(m["name"], m.get("args") or {}, base)}
            if isinstance(m, dict) and isinstance(m.get("name"), str)
            else m
            for m in args["members"]
        ]
        return {**args, "members": members}
    if name.partition(":")[0] in ADAPTER_PREFIXES:
        return args  # their arguments name no data files of looprl's reading
    try:
        cls = env_class(name)
    except Exception:
        return args  # making the env says what is wrong with its name
    found = dict(args)
    for key in getattr(cls, "path_args", ()):
        if isinstance(args.get(key), str) and args[key]:
            found[key] = find_file(args[key], base, f"env.args.{key}")
    return found


def _import_class(spec: str) -> type:
    cls = import_attribute(spec, "environment")
    # An agent environment (looprl.agents) has `run_agent` instead of `reset` and `step`.
    needed = ("tasks", "run_agent") if hasattr(cls, "run_agent") else ("tasks", "reset", "step")
    missing = [m for m in needed if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"{spec} is not an environment: it lacks {', '.join(missing)}")
    return cls
