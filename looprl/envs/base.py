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
