"""Environment bugs are counted and contained; past the budget the run stops clearly."""

from __future__ import annotations

import json

import pytest

from looprl.config import config_from_dict
from looprl.errors import LoopRLError
from looprl.loop.train import run_training


def _config(budget: int) -> dict:
    return {
        "model": {"name": "tiny-random", "tool_format": "llama3"},
        "env": {"name": "toy_envs:FlakyPickSeven", "args": {"every": 3}, "error_budget": budget},
        "rollout": {"tasks_per_step": 3, "group_size": 4, "max_new_tokens": 32},
        "train": {"steps": 2, "checkpoint_every": 1},
        "eval": {"tasks": 4},
        "logging": {"tensorboard": False},
    }


def test_env_errors_are_counted_and_excluded(tmp_path):
    run = tmp_path / "run"
    run_training(config_from_dict(_config(budget=100)), run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/env_errors"] == 4 for r in rows)  # one task of three, whole group
    assert all(r["outcomes/env_error"] == pytest.approx(4 / 12) for r in rows)
    errors = [
        json.loads(line) for line in (run / "samples/env_errors.jsonl").read_text().splitlines()
    ]
    assert errors and "simulated environment bug" in errors[0]["error"]
    assert (run / "eval/final.json").exists()


def test_error_budget_stops_the_run_with_a_clear_message(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(LoopRLError, match="env.error_budget"):
        run_training(config_from_dict(_config(budget=5)), run)
    # step 1 (4 errors) was within budget and checkpointed before step 2 spent it
    assert (run / "checkpoints" / "step_000001").exists()
