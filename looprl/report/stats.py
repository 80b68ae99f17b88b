"""The report's numbers: each side's mean reward with its 95% CI, and the paired
difference after − before over matched episodes, with a bootstrap CI that resamples
whole tasks (the episodes of one task share a board and are not independent)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from looprl.report.plots import finite

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def paired_difference(
    before: list[float],
    after: list[float],
    task_ids: list[str],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float, float] | None:
    """Mean of after − before over matched episodes and its 95% percentile-bootstrap CI.
    Each resample draws task ids with replacement and takes all episodes of each drawn
    task. Pairs with a non-finite reward are dropped; None when nothing is left."""
    d = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    keep = np.isfinite(d)
    if not keep.any():
        return None
    d, ids = d[keep], np.asarray(task_ids, dtype=object)[keep]
    _, task_of = np.unique(ids.astype(str), return_inverse=True)
    sums, counts = np.bincount(task_of, weights=d), np.bincount(task_of)
    pick = np.random.default_rng(seed).integers(0, len(sums), size=(resamples, len(sums)))
    boot = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi)


@dataclass
class Paired:
    """after − before over matched episodes: mean, bootstrap CI, and how many moved."""

    mean: float
    lo: float
    hi: float
    episodes: int
    tasks: int
    better: int
    same: int
    worse: int


def paired_stats(baseline: dict, final: dict) -> Paired | str:
    """The paired comparison of two EvalResults, or the reason it cannot be made."""
    before, after = baseline.get("rewards"), final.get("rewards")
    ids = baseline.get("task_ids")
    if before is None or after is None or ids is None:
        return "the eval files hold no per-episode rewards (written by an older looprl)"
    before, after = [finite(x) for x in before], [finite(x) for x in after]
    if not len(before) == len(after) == len(ids) or ids != final.get("task_ids", ids):
        return "baseline and final did not play the same episodes in the same order"
    result = paired_difference(before, after, ids)
    if result is None:
        return "no episode has a finite reward on both sides"
    d = [a - b for a, b in zip(after, before) if math.isfinite(a - b)]
    return Paired(
        *result,
        episodes=len(d),
        tasks=len(set(ids)),
        better=sum(x > 0 for x in d),
        same=sum(x == 0 for x in d),
        worse=sum(x < 0 for x in d),
    )


def mean_ci(result: dict) -> tuple[float, float, float]:
    lo, hi = (list(result.get("reward_ci95") or []) + [math.nan, math.nan])[:2]
    return finite(result.get("reward_mean")), finite(lo), finite(hi)


def fmt(value: Any, spec: str) -> str:
    number = finite(value)
    return "n/a" if math.isnan(number) else format(number, spec)


def reward_with_ci(result: dict) -> str:
    """'+0.123 [+0.045, +0.201]': an EvalResult's reward mean and its 95% CI."""
    mean, lo, hi = mean_ci(result)
    return f"{fmt(mean, '+.3f')} [{fmt(lo, '+.3f')}, {fmt(hi, '+.3f')}]"


def member_results(result: dict) -> dict[str, dict]:
    """A mix's EvalResult split by member (task ids `LABEL/...`): each member's rewards,
    task ids and outcomes, with its mean and normal 95% interval."""
    labels = [str(t).split("/", 1)[0] for t in result.get("task_ids") or []]
    out: dict[str, dict] = {}
    for label in dict.fromkeys(labels):
        keep = [i for i, x in enumerate(labels) if x == label]
        rewards = [finite((result.get("rewards") or [])[i]) for i in keep]
        n = len(rewards)
        mean = sum(rewards) / n
        sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
        half = 1.96 * sd / math.sqrt(n)
        out[label] = {
            "rewards": rewards,
            "n": n,
            "reward_mean": mean,
            "reward_ci95": [mean - half, mean + half],
            "task_ids": [result["task_ids"][i] for i in keep],
        }
    return out
