"""What a batch of episodes measured: reward (with a 95% interval), valid tool calls,
length, entropy, outcomes, the dataset env's scores and the judge's cost. The training
step's `rollout/*` metrics and the held-out evals (loop/evaluate.py) read the same."""

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


def sampled_entropy(episodes: list[Episode]) -> float:
    """Mean −log π(y_t) over the generated tokens, from the logprobs recorded while sampling
    (the unconstrained policy's, at the sampling temperature): a Monte Carlo estimate of
    the per-token entropy E_y~π[−log π(y)], exact in expectation where the token was sampled
    from π itself, at no extra cost. Tokens a grammar forced or narrowed add their
    surprisal instead, so on forced calls it reads as "how unlikely the policy found its
    own reply"; it falls as the policy sharpens either way. 0 without generated tokens."""
    values = [-lp for e in episodes for lp, m in zip(e.logprobs, e.loss_mask) if m]
    return sum(values) / len(values) if values else 0.0


def summarize(episodes: list[Episode]) -> dict[str, Any]:
    """Reward, validity, length, entropy and outcome statistics of a batch of episodes.
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
        "entropy": sampled_entropy(scored),
        "outcomes": {k: v / n for k, v in sorted(counts.items())},
        "env_errors": counts.get(ENV_ERROR, 0),
        "scores": score_means(scored),
        "judge": judge_cost(episodes),
    }


def by_member(episodes: list[Episode]) -> dict[str, list[Episode]]:
    """A mix's episodes by member: the label its task ids start with (`LABEL/...`)."""
    out: dict[str, list[Episode]] = {}
    for e in episodes:
        out.setdefault(e.task.id.split("/", 1)[0], []).append(e)
    return dict(sorted(out.items()))


def judge_cost(episodes: list[Episode]) -> dict[str, float]:
    """Judge requests made and seconds spent scoring (the `judge` scorer's info)."""
    verdicts = []
    for e in episodes:
        found = e.info.get("judge")
        verdicts += found if isinstance(found, list) else [found] if found else []
    if not verdicts:
        return {}
    return {
        "calls": sum(int(v.get("calls", 0)) for v in verdicts),
        "seconds": sum(float(v.get("seconds", 0.0)) for v in verdicts),
    }


def score_means(episodes: list[Episode]) -> dict[str, float]:
    """Each named score's mean, where the env reports scores (`info["scores"]`: the
    dataset env's scorers), over the episodes that have it."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        for name, value in (e.info.get("scores") or {}).items():
            if isinstance(value, int | float):
                values.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}
