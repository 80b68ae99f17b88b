"""Which groups and tasks a training step learns from: DAPO's refilling dynamic sampling
and a task curriculum. Plain functions of counts and reward lists, no tensors and no state
of their own: the loop keeps the curriculum's history and saves it with its checkpoints.

Refilling dynamic sampling (DAPO, arXiv 2503.14476, sec. 3.2): a group whose rewards are
all equal has advantage 0 everywhere and teaches nothing. Dropping it alone shrinks the
batch as the policy improves (on tic-tac-toe, 5-8 of 8 groups after a few steps); DAPO
samples more prompts until the batch holds `wanted` groups with a reward spread. Each
refill round asks for the shortfall divided by the keep rate seen so far,

    more = ceil((wanted - kept) * sampled / max(kept, 1))

capped so that no step plays more than `cap` tasks in all.

Curriculum: a task whose recent groups had a reward spread is where learning happens; one
whose recent groups were all equal at a high reward is mastered. Each task's weight is

    w = 1                                     never played
    w = 0                                     mastered: its last `retire_after` groups all
                                              equal, at reward >= mastered_reward
    w = floor + (1 - floor) * mixed share     otherwise, over its last `window` groups

and a step's tasks are drawn from a larger candidate draw with probability ∝ w, without
replacement (retired tasks only when too few others are left).
"""

from __future__ import annotations

import math

import numpy as np


def refill_count(kept: int, wanted: int, sampled: int, cap: int, multiple: int = 1) -> int:
    """Tasks to play in the next refill round (0: stop). `kept` groups with a spread out of
    `sampled` tasks so far; the answer is rounded up to a multiple of `multiple` (processes
    play equal shares) and never takes the step past `cap` tasks."""
    short = wanted - kept
    room = cap - sampled
    if short <= 0 or room <= 0:
        return 0
    more = math.ceil(short * sampled / max(kept, 1))  # the shortfall / keep rate so far
    more = math.ceil(more / multiple) * multiple
    if more > room:
        more = room // multiple * multiple
    return max(more, 0)


def record_groups(
    history: dict[str, list[list[float]]],
    task_ids: list[str],
    group_rewards: list[list[float]],
    window: int,
) -> dict[str, list[list[float]]]:
    """The history with these groups appended: per task id, its last `window` groups as
    [mixed (1.0 if the rewards differ, else 0.0), mean reward], oldest first."""
    out = {task: list(groups) for task, groups in history.items()}
    for task, rewards in zip(task_ids, group_rewards, strict=True):
        if not rewards:
            continue
        mixed = 1.0 if len(set(rewards)) > 1 else 0.0
        out[task] = (out.get(task, []) + [[mixed, sum(rewards) / len(rewards)]])[-window:]
    return out


def is_mastered(groups: list[list[float]], retire_after: int, mastered_reward: float) -> bool:
    """Its last `retire_after` groups all had equal rewards, at mastered_reward or above."""
    last = groups[-retire_after:]
    return len(last) >= retire_after and all(
        mixed == 0.0 and mean >= mastered_reward for mixed, mean in last
    )


def task_weights(
    history: dict[str, list[list[float]]],
    task_ids: list[str],
    *,
    retire_after: int,
    mastered_reward: float,
    floor: float,
) -> list[float]:
    """The curriculum weight of each task (module doc)."""
    weights = []
    for task in task_ids:
        groups = history.get(task)
        if not groups:
            weights.append(1.0)
        elif is_mastered(groups, retire_after, mastered_reward):
            weights.append(0.0)
        else:
            mixed_share = sum(mixed for mixed, _ in groups) / len(groups)
            weights.append(floor + (1.0 - floor) * mixed_share)
    return weights


def choose_tasks(weights: list[float], n: int, seed: int) -> list[int]:
    """Indices of n candidates, drawn ∝ weight without replacement; when fewer than n have
    a weight above 0, the rest are drawn uniformly from the retired ones. Sorted."""
    if n > len(weights):
        raise ValueError(f"cannot choose {n} of {len(weights)} candidates")
    rng = np.random.default_rng(seed)
    w = np.asarray(weights, dtype=float)
    live = np.flatnonzero(w > 0)
    take = min(n, len(live))
    chosen = (
        list(rng.choice(live, size=take, replace=False, p=w[live] / w[live].sum())) if take else []
    )
    if take < n:
        retired = np.flatnonzero(w <= 0)
        chosen += list(rng.choice(retired, size=n - take, replace=False))
    return sorted(int(i) for i in chosen)
