"""Learning direction guards: the real loop on a tiny model must raise the reward of a
trivial task, and with the advantage sign flipped it must lower it."""

from __future__ import annotations

import json

import pytest

import looprl.loop.groups as groups
import looprl.loop.train as train
from looprl.config import config_from_dict


def _config(steps: int = 24) -> dict:
    return {
        "model": {"name": "tiny-random", "lora": {"enabled": False}, "tool_format": "llama3"},
        "env": {"name": "toy_envs:PickSeven"},
        "rollout": {"tasks_per_step": 2, "group_size": 8, "max_new_tokens": 24},
        "algo": {"name": "gspo", "num_minibatches": 2},
        "train": {"steps": steps, "lr": 3e-3, "checkpoint_every": 0},
        "eval": {"tasks": 8, "temperature": 1.0, "samples_per_task": 4},
        "logging": {"tensorboard": False},
        "seed": 1,
    }


def _hit_rate(run_dir, first: int, last: int) -> tuple[float, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/rewards_mean"] for r in rows]
    return sum(rewards[:first]) / first, sum(rewards[-last:]) / last


def test_reward_rises(tmp_path):
    result = train.run_training(config_from_dict(_config()), tmp_path / "run")
    early, late = _hit_rate(tmp_path / "run", 4, 4)
    assert late > early + 0.2, (early, late)
    assert result["final"]["reward_mean"] > result["baseline"]["reward_mean"] + 0.2


def test_flipped_advantage_lowers_reward(tmp_path, monkeypatch):
    real = groups.group_advantages_of

    def flipped(*args, **kwargs):
        advantages, all_equal = real(*args, **kwargs)
        return [None if a is None else -a for a in advantages], all_equal

    monkeypatch.setattr(groups, "group_advantages_of", flipped)
    cfg = _config()
    result = train.run_training(config_from_dict(cfg), tmp_path / "run")
    early, late = _hit_rate(tmp_path / "run", 4, 4)
    assert late < early - 0.02 or late == 0.0, (early, late)
    assert result["final"]["reward_mean"] <= result["baseline"]["reward_mean"]


@pytest.mark.parametrize("algo", ["gspo_token", "grpo", "dr_grpo"])
def test_other_losses_learn(tmp_path, algo):
    cfg = _config(steps=16)
    cfg["algo"]["name"] = algo
    train.run_training(config_from_dict(cfg), tmp_path / "run")
    early, late = _hit_rate(tmp_path / "run", 4, 4)
    assert late > early, (algo, early, late)
