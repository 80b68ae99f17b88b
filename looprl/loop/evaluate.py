"""Evaluation on fixed held-out tasks: the same tasks, seeds and sampling before and
after training, so the before/after comparison is paired."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from looprl.types import ENV_ERROR, Episode


def mean_ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and a normal-approximation 95% interval (mean ± 1.96·sd/√n)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = 1.96 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def valid_call_rate(episodes: list[Episode]) -> float:
    """Fraction of assistant turns that produced a valid tool call."""
    turns = [m for e in episodes for m in e.messages if m.role == "assistant"]
    if not turns:
        return 0.0
    return sum(1 for m in turns if m.tool_calls and not m.parse_failure) / len(turns)


def summarize(episodes: list[Episode]) -> dict[str, Any]:
    """Reward, validity, length and outcome statistics of a batch of episodes.
    `env_error` episodes are counted in `outcomes` but left out of the reward mean."""
    scored = [e for e in episodes if e.outcome != ENV_ERROR]
    mean, lo, hi = mean_ci95([e.reward for e in scored])
    counts = Counter(e.outcome for e in episodes)
    n = max(len(episodes), 1)
    return {
        "n": len(episodes),
        "reward_mean": mean,
        "reward_ci95": [lo, hi],
        "valid_tool_call_rate": valid_call_rate(scored),
        "response_len": sum(e.response_len for e in scored) / max(len(scored), 1),
        "outcomes": {k: v / n for k, v in sorted(counts.items())},
        "env_errors": counts.get(ENV_ERROR, 0),
    }


def eval_result(episodes: list[Episode], env: str, model: str, task_seed: int) -> dict[str, Any]:
    """The EvalResult JSON object of the run-folder contract."""
    stats = summarize(episodes)
    return {
        "env": env,
        "model": model,
        "n": stats["n"],
        "reward_mean": stats["reward_mean"],
        "reward_ci95": stats["reward_ci95"],
        "valid_tool_call_rate": stats["valid_tool_call_rate"],
        "response_len": stats["response_len"],
        "outcomes": stats["outcomes"],
        "task_seed": task_seed,
        "rewards": [e.reward for e in episodes],
        "task_ids": [e.task.id for e in episodes],
    }
