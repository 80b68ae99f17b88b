"""End-to-end runs of the real CLI on the tiny model: the run-folder contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

METRIC_KEYS = {
    "step",
    "rollout/rewards_mean",
    "rollout/rewards_std",
    "response_len",
    "rollout/valid_tool_call_rate",
    "train/loss",
    "train/clip_frac",
    "train/grad_norm",
    "train/lr",
    "train/zero_std_groups",
    "perf/step_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/peak_rss_gb",
}
EVAL_KEYS = {
    "env",
    "model",
    "n",
    "reward_mean",
    "reward_ci95",
    "valid_tool_call_rate",
    "response_len",
    "outcomes",
    "task_seed",
}
SMALL = [
    "--set", "model.name=tiny-random",
    "--set", "rollout.tasks_per_step=2",
    "--set", "rollout.group_size=4",
    "--set", "rollout.max_new_tokens=48",
    "--set", "eval.tasks=4",
    "--set", "train.checkpoint_every=1",
]  # fmt: skip


def looprl(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("smoke") / "run"
    res = looprl("run", *SMALL, "--set", "train.steps=2", "--out", run)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def test_run_folder_contract(run_dir):
    for path in ("config.yaml", "metrics.jsonl", "eval/baseline.json", "eval/final.json",
                 "samples/baseline.jsonl", "samples/final.jsonl", "report.md"):  # fmt: skip
        assert (run_dir / path).is_file(), path
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row.keys() >= METRIC_KEYS, METRIC_KEYS - row.keys()
        assert row["perf/peak_rss_gb"] > 0 and row["perf/step_s"] > 0
    baseline = json.loads((run_dir / "eval/baseline.json").read_text())
    final = json.loads((run_dir / "eval/final.json").read_text())
    assert baseline.keys() >= EVAL_KEYS and final.keys() >= EVAL_KEYS
    assert baseline["task_ids"] == final["task_ids"]  # retest on the same tasks
    assert baseline["n"] == 4 * 4  # eval.tasks × eval.samples_per_task
    assert (run_dir / "checkpoints" / "step_000002" / "trainable.safetensors").exists()
    assert "before" in (run_dir / "report.md").read_text()


def test_tensorboard_has_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("rollout/rewards_mean")]
    assert steps == [1, 2]


def test_existing_run_folder_is_not_overwritten(run_dir):
    before = (run_dir / "metrics.jsonl").read_text()
    res = looprl("run", *SMALL, "--out", run_dir)
    assert res.returncode == 2
    assert "--resume" in res.stderr and "--force" in res.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_continues_from_the_last_checkpoint(run_dir, tmp_path):
    import shutil

    run = tmp_path / "resumed"
    shutil.copytree(run_dir, run)
    res = looprl("run", *SMALL, "--set", "train.steps=3", "--out", run, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_eval_a_checkpoint(run_dir, tmp_path):
    out = tmp_path / "eval.json"
    ckpt = run_dir / "checkpoints" / "step_000002"
    res = looprl("eval", *SMALL, "--checkpoint", ckpt, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    final = json.loads((run_dir / "eval/final.json").read_text())
    # same weights, same tasks, same greedy decoding: the same rewards
    assert result["rewards"] == final["rewards"]


def test_multi_turn_game_full_finetune_with_gradient_checkpointing(tmp_path):
    run = tmp_path / "game"
    res = looprl(
        "run", *SMALL,
        "--set", "env.name=tictactoe-game",
        "--set", "env.args={opponent: random}",
        "--set", "model.lora.enabled=false",
        "--set", "model.gradient_checkpointing=true",
        "--set", "algo.name=grpo",
        "--set", "train.steps=1",
        "--out", run,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    row = metrics(run)[0]
    assert row["rollout/logprob_gap"] < 1e-3  # engine and trainer agree over many turns
    assert row["response_len"] > 0
    sample = json.loads((run / "samples" / "final.jsonl").read_text().splitlines()[0])
    assert any(m["role"] == "tool" for m in sample["messages"])


def test_export_gives_a_plain_transformers_model(run_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    res = looprl("export", run_dir, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
