"""The groups one training step learns from.

A step plays `tasks_per_step` train tasks, `group_size` episodes each, and turns their
rewards into group-relative advantages. Two levers change which groups those are (the
formulas are in algo/selection.py):

- `algo.dynamic_sampling` drops groups whose rewards are all equal (advantage 0); with
  `algo.max_oversample` > 1 the step then plays more tasks, round after round, until
  `tasks_per_step` groups with a reward spread are kept or the cap is reached (DAPO).
- `algo.entropy_coef` β adds β × (the episode's decision surprisal − its group's mean)
  to each advantage (`bonus`: loop/decisions.py; algo/advantages.py), so within a group
  the choice sampled less often is favoured, also among equal rewards.
- `algo.greedy_samples` 1 makes one member of each group the policy's greedy episode
  (T = 0, scored at T = 1 like the samples): its advantage ranks the policy's argmax
  against its own samples, so a group whose samples beat the argmax moves it directly.
- `algo.expert_samples` k makes the last k members of each group the task's expert
  episode (the env's demonstration, loop/guidance.py) instead of policy samples.
- `curriculum.enabled` draws `curriculum.candidates` times more tasks than it plays and
  picks among them by their recent groups: mixed ones first, mastered ones retired. Its
  history is part of the loop state saved with each checkpoint, so a resumed run picks
  the same tasks as an uninterrupted one.

Round 0 of a step without the curriculum plays exactly the tasks and random streams the
loop always has; refill rounds take new task seeds and continue the episode streams.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from looprl.algo import (
    Advantage,
    choose_tasks,
    episode_advantages,
    is_mastered,
    record_groups,
    refill_count,
    task_weights,
)
from looprl.config import Config
from looprl.engine import SamplingParams
from looprl.loop.dist import Dist
from looprl.loop.evaluate import distinct_tasks
from looprl.loop.guidance import with_experts, with_members
from looprl.types import Episode, Task

REFILL_SEED_STRIDE = 500_009  # a refill round's task seed: the step's seed + round × this


@dataclass
class StepGroups:
    """Every episode a step played, the advantage of each (None: takes no part), and the
    step's metrics about its groups."""

    episodes: list[Episode] = field(default_factory=list)
    advantages: list[Advantage | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def play_step(
    cfg: Config,
    probe: Any,
    play: Any,
    dist: Dist,
    step: int,
    history: dict[str, list[list[float]]],
    bonus: Callable[[Episode], float] | None = None,
    expert: Callable[[Task], Episode] | None = None,
) -> tuple[StepGroups, dict[str, list[list[float]]]]:
    """Play the step's groups (refilling dropped ones); returns them and the curriculum
    history updated with every group played. With `bonus` (an episode's decision
    surprisal), the advantages take `algo.entropy_coef` × its spread in the group. A
    group is its samples, then `algo.greedy_samples` greedy episodes, then with `expert`
    (a task's expert episode) `algo.expert_samples` copies of that episode."""
    wanted, group = cfg.rollout.tasks_per_step, cfg.rollout.group_size
    experts = cfg.algo.expert_samples if expert is not None else 0
    greedy = cfg.algo.greedy_samples
    anchored = experts > 0 and cfg.algo.expert_baseline == "samples"
    refill = cfg.algo.dynamic_sampling and cfg.algo.max_oversample > 1
    cap = max(wanted, math.floor(wanted * cfg.algo.max_oversample)) if refill else wanted
    seed = cfg.seed * 1_000_003 + step
    params = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=seed,
    )
    out = StepGroups()
    weights: list[float] = []
    kept = sampled = 0
    count, round_ = wanted, 0
    while count:
        tasks, chosen_weights = step_tasks(
            cfg, probe, count, seed + REFILL_SEED_STRIDE * round_, history
        )
        weights += chosen_weights
        # this rank plays its share of whole groups; every rank then sees all episodes
        mine = dist.share(range(len(tasks)))
        # a task's samples take random streams (the step's tasks so far) × (samples a
        # task) on: the streams of one process playing the whole batch
        sampling = group - experts - greedy
        played = play([tasks[i] for i in mine for _ in range(sampling)], params=params,
                      first_index=(sampled + (mine[0] if mine else 0)) * sampling)  # fmt: skip
        if greedy:  # T = 0 needs no random stream
            argmax = play([tasks[i] for i in mine], params=replace(params, temperature=0.0))
            played = with_members(played, [[e] for e in argmax])
        if experts:
            played = with_experts(played, [tasks[i] for i in mine], experts, expert)
        episodes = dist.gather(played)
        graded = [graded_turns(e) for e in episodes] if cfg.algo.turn_reward_weight else None
        advantages, zero_std = episode_advantages(
            [e.reward for e in episodes], [e.trainable for e in episodes], group,
            scale=cfg.algo.scale_advantages, dynamic_sampling=cfg.algo.dynamic_sampling,
            turn_rewards=graded,
            turn_weight=cfg.algo.turn_reward_weight, turn_gamma=cfg.algo.turn_gamma,
            bonus=[bonus(e) if e.trainable else 0.0 for e in episodes] if bonus else None,
            bonus_weight=cfg.algo.entropy_coef,
            anchors=[e.expert for e in episodes] if anchored else None,
        )  # fmt: skip
        kept = _keep_at_most(advantages, group, wanted, kept)
        if round_ == 0:
            out.metrics["train/zero_std_groups"] = zero_std
        history = _remember(cfg, history, episodes, group)
        out.episodes += episodes
        out.advantages += advantages
        sampled += len(tasks)
        round_ += 1
        count = refill_count(kept, wanted, sampled, cap, dist.world) if refill else 0
    out.metrics["train/kept_groups"] = kept
    out.metrics["train/oversample_ratio"] = sampled / wanted
    if cfg.curriculum.enabled:
        out.metrics.update(curriculum_metrics(cfg, history, weights))
    return out, history


def greedy_member(cfg: Config, episode: Episode) -> bool:
    """Whether the episode is a group's greedy member (`algo.greedy_samples`)."""
    return cfg.algo.greedy_samples > 0 and episode.temperature == 0 and not episode.expert


def graded_turns(episode: Episode) -> list[float]:
    """The episode's per-turn rewards, one for each of its turns: a turn the environment
    did not grade (none does in the built-in envs once the episode is trainable) counts 0."""
    rewards = episode.turn_rewards[: len(episode.turns)]
    return rewards + [0.0] * (len(episode.turns) - len(rewards))


def step_tasks(
    cfg: Config, probe: Any, n: int, seed: int, history: dict[str, list[list[float]]]
) -> tuple[list[Task], list[float]]:
    """n train tasks: the env's draw, or the curriculum's pick among more candidates (with
    the weights of those picked)."""
    if not cfg.curriculum.enabled:
        return probe.tasks("train", n=n, seed=seed), []
    drawn = probe.tasks("train", n=n * cfg.curriculum.candidates, seed=seed)
    candidates = distinct_tasks(drawn)
    if len(candidates) < n:
        return probe.tasks("train", n=n, seed=seed), []  # a pool too small to choose from
    c = cfg.curriculum
    weights = task_weights(
        history, [t.id for t in candidates], retire_after=c.retire_after,
        mastered_reward=c.mastered_reward, floor=c.floor,
    )  # fmt: skip
    chosen = choose_tasks(weights, n, seed)
    return [candidates[i] for i in chosen], [weights[i] for i in chosen]


def _keep_at_most(advantages: list[Advantage | None], group: int, wanted: int, kept: int) -> int:
    """Drop (set to None) the groups past the `wanted`-th kept one; the new kept count."""
    for start in range(0, len(advantages), group):
        if all(a is None for a in advantages[start : start + group]):
            continue
        if kept >= wanted:
            advantages[start : start + group] = [None] * len(advantages[start : start + group])
        else:
            kept += 1
    return kept


def _remember(
    cfg: Config, history: dict[str, list[list[float]]], episodes: list[Episode], group: int
) -> dict[str, list[list[float]]]:
    if not cfg.curriculum.enabled:
        return history
    ids, rewards = [], []
    for start in range(0, len(episodes), group):
        members = [e for e in episodes[start : start + group] if e.trainable]
        if members:
            ids.append(members[0].task.id)
            rewards.append([e.reward for e in members])
    return record_groups(history, ids, rewards, cfg.curriculum.window)


def curriculum_metrics(
    cfg: Config, history: dict[str, list[list[float]]], weights: list[float]
) -> dict[str, float]:
    """curriculum/*: tasks seen and retired so far, the mean weight of the tasks picked,
    and the share of the history's recent groups that were mixed."""
    c = cfg.curriculum
    groups = [g for task_groups in history.values() for g in task_groups]
    retired = sum(is_mastered(g, c.retire_after, c.mastered_reward) for g in history.values())
    return {
        "curriculum/tasks_seen": len(history),
        "curriculum/retired": retired,
        "curriculum/weight_mean": sum(weights) / len(weights) if weights else 1.0,
        "curriculum/mixed_share": sum(m for m, _ in groups) / len(groups) if groups else 0.0,
    }
