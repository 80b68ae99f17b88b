"""The optional levers of a step, built once for a run and carried as one object: the
decision views of `algo.loss_on: free` and `algo.experimental.entropy_coef`, and the expert
episodes of `algo.expert_samples`. loop/groups.py `play_step` (and the rollout thread of
loop/overlap.py, which calls it) applies them; loop/step.py reads them for its metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from looprl.config import Config
from looprl.envs import env_factory
from looprl.loop.decisions import decision_view, grammar_cache
from looprl.loop.guidance import safe_expert_episode
from looprl.loop.policy import Policy
from looprl.types import Episode, Task


@dataclass
class Levers:
    """What the optional levers of a step need, built once for a run: `decide`, an
    episode's decision view (`algo.loss_on: free` trains on the views;
    `algo.experimental.entropy_coef` takes its bonus from them); `expert`, a task's expert
    episode (`algo.expert_samples`).
    `Levers()`: none of them."""

    decide: Callable[[Episode], Episode] | None = None
    expert: Callable[[Task], Episode] | None = None
    loss_on_views: bool = False

    @classmethod
    def of(cls, cfg: Config, policy: Policy) -> Levers:
        decide = None
        if cfg.algo.loss_on == "free" or cfg.algo.experimental.entropy_coef > 0:
            grammars = grammar_cache(policy)
            decide = partial(decision_view, grammars=grammars, tokenizer=policy.tokenizer)
        expert = None
        if cfg.algo.expert_samples:
            expert = partial(
                safe_expert_episode,
                env_factory(cfg.env.name, cfg.env.args),
                renderer=policy.renderer,
                temperature=cfg.rollout.temperature,
            )
        return cls(decide, expert, cfg.algo.loss_on == "free")
