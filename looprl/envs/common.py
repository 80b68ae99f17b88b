"""Small parts the built-in environments share: argument checks, seeded task indices and
picking the tool call to act on."""

from __future__ import annotations

import importlib
import math
import os
import random
import sys
from typing import Any, ClassVar, TypeVar

from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, StepResult, ToolCall

T = TypeVar("T")


def check_int(name: str, value: Any, low: float = -math.inf, high: float = math.inf) -> int:
    """`value` if it is an integer (not a bool) in [low, high], else a clear EnvError."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bound = "" if low == -math.inf else f" >= {low}" if high == math.inf else f" {low}..{high}"
        raise EnvError(f"{name}={value!r} is invalid: expected an integer{bound}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """`value` if it is a number strictly between 0 and 1, else a clear EnvError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise EnvError(f"{name}={value!r} is invalid: expected 0 < f < 1")
    return float(value)


def check_failure_reward(value: Any) -> float:
    """A reward for a reply that cannot be scored: a number <= 0, else a clear EnvError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not -1e6 <= value <= 0:
        raise EnvError(f"failure_reward={value!r} is invalid: expected a number <= 0")
    return float(value)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> Any:
    """`value` if it is one of `allowed`, else a clear EnvError."""
    if value not in allowed:
        raise EnvError(f"{name}={value!r} is invalid: expected one of {', '.join(allowed)}")
    return value


def sample_items(items: list[Any], n: int | None, seed: int) -> list[Any]:
    """All `items` in order (n=None) or a seeded sample of `n`; for n > len(items) the sample
    cycles through fresh shuffles, so every item is used before any is repeated."""
    if n is None:
        return list(items)
    check_int("n", n, 0)
    rng = random.Random(seed)
    out: list[Any] = []
    while len(out) < n and items:
        out.extend(rng.sample(items, min(n - len(out), len(items))))
    return out


def task_indices(env_name: str, split: str, n: int | None, seed: int, eval_size: int) -> list[int]:
    """Eval: indices 0..eval_size-1 (all, or a seeded sample of `n`). Train: `n` indices of
    an unbounded stream, so `n` is required. The env maps (split, index) to disjoint seeds."""
    check_choice(f"{env_name}: split", split, ("train", "eval"))
    if split == "eval":
        return sample_items(list(range(eval_size)), n, seed)
    if n is None:
        raise EnvError(f"{env_name}: the train split is unbounded; pass n")
    check_int("n", n, 0)
    return random.Random(seed).sample(range(2**31), n)


def first_call(message: Message, tool_name: str) -> tuple[ToolCall | None, str | None]:
    """The call to act on (the first; any further calls are ignored), or else the
    parse-failure label."""
    if message.parse_failure is not None:
        if message.parse_failure not in PARSE_FAILURES:
            raise EnvError(f"unknown parse_failure {message.parse_failure!r}")
        return None, message.parse_failure
    if not message.tool_calls:
        return None, "no_tool_call"
    call = message.tool_calls[0]
    return (call, None) if call.name == tool_name else (None, "unknown_tool")


def import_attribute(spec: str, what: str) -> Any:
    """The object `package.module:name` names (modules next to you import, as with
    `python -m`), or a clear EnvError saying which part is missing; `what` names the
    module's role in the messages ("environment", "scorer")."""
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise EnvError(f"cannot import {what} module {module_name!r}: {err}") from None
    found = getattr(module, attr, None)
    if found is None:
        raise EnvError(f"module {module_name!r} has no attribute {attr!r}")
    return found


def lowest_reward(env: Any) -> float:
    """The bottom of the env's `reward_range` (0 when it declares none)."""
    return float(getattr(env, "reward_range", (0.0, 0.0))[0])


def check_reward(env: Any, reward: Any) -> None:
    """An env's reward outside its declared `reward_range` (or not a finite number) is a
    bug in the env: raised here, so the episode is `env_error` with the value named."""
    low, high = getattr(env, "reward_range", (-math.inf, math.inf))
    if not (isinstance(reward, int | float) and math.isfinite(reward) and low <= reward <= high):
        raise EnvError(
            f"{type(env).__name__}.step returned reward={reward!r}, outside its "
            f"reward_range [{low}, {high}]"
        )


class Adapter:
    """The base of an ecosystem adapter named `prefix:target` (`reasoning-gym:leg_counting`,
    `verifiers:my_tasks:Taskset`): the registry calls `bind(target)`, which gives a subclass
    whose `name` is the whole name and whose `target` the part after the prefix; the
    adapter's `__init__` reads `self.target`."""

    prefix: ClassVar[str] = ""
    target: ClassVar[str] = ""
    target_help: ClassVar[str] = "<target>"  # how `looprl envs` shows the target
    name: ClassVar[str] = ""

    @classmethod
    def bind(cls, target: str) -> type:
        if not target.strip():
            raise EnvError(
                f"{cls.prefix}: name what to run after the colon, as in "
                f"'{cls.prefix}:{cls.target_help}'"
            )
        attrs = {"target": target.strip(), "name": f"{cls.prefix}:{target.strip()}"}
        return type(cls.__name__, (cls,), attrs)


# ---------------------------------------------------------------- a single answer's step


def in_progress(env_name: str, state: T | None) -> T:
    """The episode's state, or the EnvError of a `step` with no episode in progress."""
    if state is None:
        raise EnvError(f"{env_name}: step() called without an episode in progress")
    return state


def unscored(message: Message, failure: str, failure_reward: float) -> StepResult:
    """The end of an episode whose reply cannot be scored (it did not parse): the parse
    failure is the outcome and the env's `failure_reward` the reward."""
    info = {"failure": failure, "detail": message.parse_detail}
    return StepResult([], done=True, reward=failure_reward, outcome=failure, info=info)


def reward_label(credit: float, solved: bool | None = None) -> str:
    """The outcome of a graded answer: `correct` when solved (by default: full credit, 1),
    `wrong` with no credit, else `partial`."""
    if credit >= 1.0 if solved is None else solved:
        return "correct"
    return "wrong" if credit <= 0.0 else "partial"
