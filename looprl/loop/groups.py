"""The groups one training step learns from.

A step plays `tasks_per_step` train tasks, `group_size` episodes each, and turns their
rewards into group-relative advantages. Two levers change which groups those are (the
formulas are in algo/selection.py):

- `algo.dynamic_sampling` drops groups whose rewards are all equal (advantage 0); with
  `algo.max_oversample` > 1 the step then plays more tasks, round after round, until
  `tasks_per_step` groups with a reward spread are kept or the cap is reached (DAPO).
- `algo.experimental.entropy_coef` β adds β × (the episode's decision surprisal − its group's mean)
  to each advantage (the decision views: loop/decisions.py; algo/advantages.py), so
  within a group the choice sampled less often is favoured, also among equal rewards.
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

A step's groups are `Group` records from the moment they are played to the update: the
task, its members in play order, each member's advantage, and (when the loss or the bonus
needs them) each member's decision view.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from looprl.algo import (
    Advantage,
    choose_tasks,
    group_advantages_of,
    is_mastered,
    record_groups,
    refill_count,
    task_weights,
)
from looprl.config import Config
from looprl.engine import SamplingParams
from looprl.envs import Environment
from looprl.loop.decisions import decision_surprisal
from looprl.loop.dist import Dist
from looprl.loop.levers import Levers
from looprl.loop.play import Player, distinct_tasks
from looprl.seeds import refill_seed, step_seed
from looprl.types import Episode, Task


@dataclass
class Group:
    """One task's episodes in a step and what the update needs of them.

    `episodes`: the group's members in play order: the policy's samples, then
    `algo.greedy_samples` greedy episodes, then `algo.expert_samples` expert episodes.
    `advantages`: one per member; None: it takes no part (an env error, nothing generated,
    or the whole group dropped by dynamic sampling or past the step's kept groups).
    `views`: each member's decision view (loop/decisions.py), when `algo.loss_on: free` or
    the entropy bonus needs them. `all_equal`: the trainable members' rewards are equal."""

    task: Task
    episodes: list[Episode]
    advantages: list[Advantage | None] = field(default_factory=list)
    views: list[Episode] | None = None
    all_equal: bool = False

    @property
    def kept(self) -> bool:
        return any(a is not None for a in self.advantages)

    def drop(self) -> None:
        self.advantages = [None] * len(self.episodes)

    def learners(self, views: bool = False) -> list[tuple[Episode, Advantage]]:
        """(episode, advantage) of each member that takes part; with `views`, its decision
        view instead, and a member whose view has no decision token takes no part."""
        if not views:
            return [(e, a) for e, a in zip(self.episodes, self.advantages) if a is not None]
        assert self.views is not None, "decision views were not built for this step"
        pairs = zip(self.views, self.advantages)
        return [(v, a) for v, a in pairs if a is not None and v.response_len > 0]


@dataclass
class StepGroups:
    """Every group a step played (refill rounds after round 0, in play order) and the
    step's metrics about them."""

    groups: list[Group] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def episodes(self) -> list[Episode]:
        return [e for group in self.groups for e in group.episodes]

    def learners(self, views: bool = False) -> list[tuple[Episode, Advantage]]:
        return [pair for group in self.groups for pair in group.learners(views)]


def play_step(
    cfg: Config,
    probe: Environment,
    play: Player,
    dist: Dist,
    step: int,
    history: dict[str, list[list[float]]],
    levers: Levers | None = None,
) -> tuple[StepGroups, dict[str, list[list[float]]]]:
    """Play the step's groups (refilling dropped ones); returns them and the curriculum
    history updated with every group played. With `levers.decide` (an episode's decision
    view) each group keeps its members' views, and with `algo.experimental.entropy_coef`
    the advantages take β × the spread of their decision surprisal. With `levers.expert`
    (a task's expert episode) the last `algo.expert_samples` members of a group are copies
    of that episode."""
    levers = levers or Levers()
    wanted = cfg.rollout.tasks_per_step
    refill = cfg.algo.dynamic_sampling and cfg.algo.max_oversample > 1
    cap = max(wanted, math.floor(wanted * cfg.algo.max_oversample)) if refill else wanted
    seed = step_seed(cfg.seed, step)
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
        tasks, chosen_weights = step_tasks(cfg, probe, count, refill_seed(seed, round_), history)
        weights += chosen_weights
        # this rank plays its share of whole groups; every rank then sees all of them
        mine = dist.share(range(len(tasks)))
        groups = dist.gather(
            play_groups(
                cfg,
                play,
                [tasks[i] for i in mine],
                params,
                sampled + (mine[0] if mine else 0),
                levers.expert,
            )
        )
        kept = score_groups(cfg, groups, kept, levers.decide)
        if round_ == 0:
            out.metrics["train/zero_std_groups"] = sum(g.all_equal for g in groups)
        history = _remember(cfg, history, groups)
        out.groups += groups
        sampled += len(tasks)
        round_ += 1
        count = refill_count(kept, wanted, sampled, cap, dist.world) if refill else 0
    out.metrics["train/kept_groups"] = kept
    out.metrics["train/oversample_ratio"] = sampled / wanted
    if cfg.curriculum.enabled:
        out.metrics.update(curriculum_metrics(cfg, history, weights))
    return out, history


def replay_step(cfg: Config, groups: list[Group], levers: Levers | None = None) -> StepGroups:
    """A step of saved groups (loop/replay.py), scored again under this run's config as
    `play_step` scores the groups it plays; round 0 is the first `tasks_per_step`."""
    wanted = cfg.rollout.tasks_per_step
    out = StepGroups(groups)
    kept = score_groups(cfg, groups, 0, (levers or Levers()).decide)
    out.metrics["train/zero_std_groups"] = sum(g.all_equal for g in groups[:wanted])
    out.metrics["train/kept_groups"] = kept
    out.metrics["train/oversample_ratio"] = len(groups) / wanted
    return out


def score_groups(
    cfg: Config, groups: list[Group], kept: int, decide: Callable[[Episode], Episode] | None
) -> int:
    """Score each group (its decision views first, with `decide`); a group past the
    step's `tasks_per_step` kept ones is dropped (refills are played in parallel). Returns
    the kept count, from `kept` before these groups."""
    for group in groups:
        if decide is not None:
            group.views = [decide(e) if e.trainable else e for e in group.episodes]
        score_group(cfg, group)
        if group.kept and kept >= cfg.rollout.tasks_per_step:
            group.drop()
        kept += group.kept
    return kept


def play_groups(
    cfg: Config,
    play: Player,
    tasks: list[Task],
    params: SamplingParams,
    first: int,
    expert: Callable[[Task], Episode] | None,
) -> list[Group]:
    """One group for each of `tasks` (this process's share; `first`: the index of the first
    among all the step's tasks so far). A task's samples take random streams (its index) ×
    (samples a task) on: the streams of one process playing the whole batch."""
    experts = cfg.algo.expert_samples if expert is not None else 0
    greedy = cfg.algo.greedy_samples
    sampling = cfg.rollout.group_size - experts - greedy
    played = play(
        [t for t in tasks for _ in range(sampling)], params=params, first_index=first * sampling
    )
    groups = [Group(t, played[j * sampling : (j + 1) * sampling]) for j, t in enumerate(tasks)]
    if greedy:  # T = 0 needs no random stream
        for group, argmax in zip(groups, play(tasks, params=replace(params, temperature=0.0))):
            group.episodes.append(argmax)
    if experts:
        for group in groups:
            episode = expert(group.task)
            group.episodes += [episode] + [replace(episode) for _ in range(experts - 1)]
    return groups


def score_group(cfg: Config, group: Group) -> None:
    """The group's advantages (algo/advantages.py) under the config's levers."""
    members = group.episodes
    anchored = cfg.algo.expert_samples > 0 and cfg.algo.experimental.expert_baseline == "samples"
    bonus = None
    if group.views is not None and cfg.algo.experimental.entropy_coef > 0:
        bonus = [
            decision_surprisal(v) if e.trainable else 0.0 for e, v in zip(members, group.views)
        ]
    group.advantages, group.all_equal = group_advantages_of(
        [e.reward for e in members],
        [e.trainable for e in members],
        scale=cfg.algo.scale_advantages,
        dynamic_sampling=cfg.algo.dynamic_sampling,
        turn_rewards=[graded_turns(e) for e in members] if cfg.algo.turn_reward_weight else None,
        turn_weight=cfg.algo.turn_reward_weight,
        turn_gamma=cfg.algo.turn_gamma,
        bonus=bonus,
        bonus_weight=cfg.algo.experimental.entropy_coef,
        anchors=[e.expert for e in members] if anchored else None,
    )


def greedy_member(cfg: Config, episode: Episode) -> bool:
    """Whether the episode is a group's greedy member (`algo.greedy_samples`)."""
    return cfg.algo.greedy_samples > 0 and episode.temperature == 0 and not episode.expert


def graded_turns(episode: Episode) -> list[float]:
    """The episode's per-turn rewards, one for each of its turns: a turn the environment
    did not grade (none does in the built-in envs once the episode is trainable) counts 0."""
    rewards = episode.turn_rewards[: len(episode.turns)]
    return rewards + [0.0] * (len(episode.turns) - len(rewards))


def step_tasks(
    cfg: Config, probe: Environment, n: int, seed: int, history: dict[str, list[list[float]]]
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
        history,
        [t.id for t in candidates],
        retire_after=c.retire_after,
        mastered_reward=c.mastered_reward,
        floor=c.floor,
    )
    chosen = choose_tasks(weights, n, seed)
    return [candidates[i] for i in chosen], [weights[i] for i in chosen]


def _remember(
    cfg: Config, history: dict[str, list[list[float]]], groups: list[Group]
) -> dict[str, list[list[float]]]:
    if not cfg.curriculum.enabled:
        return history
    ids, rewards = [], []
    for group in groups:
        members = [e for e in group.episodes if e.trainable]
        if members:
            ids.append(group.task.id)
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
