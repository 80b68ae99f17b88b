"""Playing episodes with a policy, for training and evaluation alike: `player` builds the
`Player` of a run (built-in envs through loop/rollout.py, agent envs through
looprl/agents/runner.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from looprl.config import Config
from looprl.engine import SamplingParams, Thinking
from looprl.envs import Environment, env_factory, group_scorer
from looprl.loop.policy import Policy
from looprl.loop.rollout import run_episodes
from looprl.loop.shard import rollout_weights
from looprl.types import Episode, Task


class Player(Protocol):
    """Plays one episode per task (repeat a task for a group), in order, with one policy:
    `first_index` is the first episode's random stream (its index in the whole batch when
    this process plays a share of it, loop/dist.py); `on_progress(n)` hears how many have
    ended."""

    def __call__(
        self,
        tasks: list[Task],
        *,
        params: SamplingParams,
        first_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Episode]: ...


def player(cfg: Config, policy: Policy, probe: Environment) -> Player:
    """`play(tasks, params=..., first_index=0) -> episodes` with this policy, in fresh env
    instances (agent environments, which have `run_agent`, are played by
    looprl.agents); `first_index` is the first episode's index in the whole batch
    when this process plays a share of it (loop/dist.py)."""
    from looprl.agents import is_agent_env, run_agents

    common = {
        "make_env": env_factory(cfg.env.name, cfg.env.args),
        "engine": policy.engine,
        "renderer": policy.renderer,
        "max_turns": probe.max_turns,
        "max_episode_tokens": cfg.rollout.max_episode_tokens,
    }
    score_groups = None
    if is_agent_env(probe):
        play: Player = partial(run_agents, **common)
    else:
        opened = cfg.rollout.think == "tagged" and policy.renderer.opens_thinking
        thinking = Thinking(cfg.rollout.think, cfg.rollout.think_max_tokens, opened)
        play = partial(run_episodes, **common, thinking=thinking)
        score_groups = group_scorer(probe)

    def play_whole(tasks: list[Task], **kwargs: Any) -> list[Episode]:
        """The rollout phase on whole weights (train.shard=fsdp: gathered once, or pushed to
        the vllm engine's server tensor by tensor, loop/shard.py); a group judge's scores
        come once the groups are played (the dataset env)."""
        with rollout_weights(policy.model, common["engine"]):
            episodes = play(tasks, **kwargs)
        if callable(score_groups):
            score_groups(episodes)
        return episodes

    return play_whole


def distinct_tasks(tasks: list) -> list:
    """Each task once, in order of first appearance."""
    return list({task.id: task for task in tasks}.values())
