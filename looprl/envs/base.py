"""The environment protocol.

An environment *class* knows its tasks; an environment *instance* plays one episode:

    env = EnvCls(**args)
    tasks = env.tasks("train", n=64, seed=0)     # deterministic, splits never overlap
    obs = env.reset(tasks[0])                     # messages, tool schemas, tool_choice
    result = env.step(assistant_message)          # repeat until result.done

`step` receives the assistant `Message` already parsed by the chat layer: either
`tool_calls` (validated against the tool schemas) or `parse_failure` set to one of
`no_tool_call`, `bad_json`, `unknown_tool`, `bad_arguments`. Malformed output is an
outcome with a reward, never an exception. An exception raised by `step` is a bug in
the environment: the rollout marks that episode `env_error` and goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from looprl.types import Message, Observation, StepResult, Task


@runtime_checkable
class Environment(Protocol):
    name: ClassVar[str]
    description: ClassVar[str]  # one line, shown by `looprl envs`
    outcomes: ClassVar[tuple[str, ...]]  # every label `step` can return
    reward_range: ClassVar[tuple[float, float]]
    max_turns: int  # assistant turns before the rollout truncates the episode

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Deterministic tasks of `split` ("train" or "eval"); the splits never overlap."""
        ...

    def reset(self, task: Task) -> Observation:
        """Start an episode of `task`."""
        ...

    def step(self, message: Message) -> StepResult:
        """Answer one parsed assistant message."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What an environment can do beyond `tasks`, `reset` and `step`, as its class declares
    it with these optional members (a class written for an older looprl declares them the
    same way). The loop asks `capabilities(env)`, never the environment's attributes:

    - `demonstrations(task) -> list[Message] | None`: expert replies (the SFT warm start,
      `algo.expert_samples`);
    - `gives_turn_rewards = True`: each step's `StepResult.turn_reward` grades the turn
      (`algo.turn_reward_weight`);
    - `plays_snapshot = True`: an opponent that plays a snapshot of the policy, which the
      loop provides (loop/snapshot.py);
    - `score_groups(tasks, episodes)`: a judge that scores a task's episodes together
      (a data file's `mode: group` judge; `scorers` lists the env's scorers);
    - `run_agent(client, task)`: a bring-your-own agent instead of `reset`/`step`;
    - `solved_outcomes`: the outcome labels that count as the task solved."""

    demonstrations: bool = False
    turn_rewards: bool = False
    snapshot_opponent: bool = False
    group_judge: bool = False  # a scorer that ranks a group together (`mode: group`)
    agent: bool = False
    solved: tuple[str, ...] = ()


def capabilities(env: Any) -> Capabilities:
    """An environment's capabilities, read once from what it declares."""
    return Capabilities(
        demonstrations=callable(getattr(env, "demonstrations", None)),
        turn_rewards=gives_turn_rewards(env),
        snapshot_opponent=bool(getattr(env, "plays_snapshot", False)),
        group_judge=any(getattr(s, "group", False) for s in getattr(env, "scorers", [])),
        agent=callable(getattr(env, "run_agent", None)),
        solved=solved_outcomes(env),
    )


def group_scorer(env: Any) -> Callable[..., Any] | None:
    """The environment's `score_groups`, if it scores a task's episodes together."""
    score = getattr(env, "score_groups", None)
    return score if callable(score) else None


def solved_outcomes(env: Any) -> tuple[str, ...]:
    """The outcome labels that count as the task solved, if the environment declares them
    (an optional `solved_outcomes` attribute): the report checks that a rising reward
    comes with more solved episodes, not only with fewer malformed ones."""
    return tuple(getattr(env, "solved_outcomes", ()) or ())


def gives_turn_rewards(env: Any) -> bool:
    """Whether the environment grades each assistant turn (`StepResult.turn_reward`), as it
    declares with an optional `gives_turn_rewards` attribute."""
    return bool(getattr(env, "gives_turn_rewards", False))


def demonstrations(env: Any, task: Task) -> list[Message] | None:
    """Expert assistant messages for `task`, if the environment provides them (for SFT)."""
    fn = getattr(env, "demonstrations", None)
    return fn(task) if callable(fn) else None
