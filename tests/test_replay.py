"""logging.save_rollouts and `looprl run --replay RUN`: the steps trained on a saved run's
groups, without sampling, scored under the replaying run's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.cli import app

TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=4", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]", "--set", "train.steps=3",
        "--set", "train.lr=0.05"]  # fmt: skip
ROLLOUT = ("rollout/rewards_mean", "rollout/rewards_std", "response_len", "outcomes/optimal",
           "outcomes/illegal", "rollout/entropy")  # fmt: skip


def _run(out: Path, *args: str, code: int = 0):
    result = CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert result.exit_code == code, result.output
    return result


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved") / "run"
    _run(out, "--set", "logging.save_rollouts=true")
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == [
        "step_000001.pkl.gz", "step_000002.pkl.gz", "step_000003.pkl.gz",
    ]  # fmt: skip
    return out


def test_a_replay_with_nothing_changed_is_the_saved_run(saved, tmp_path):
    out = tmp_path / "replay"
    _run(out, "--replay", str(saved))
    # the saved run took its engine's logprobs as the old ones, the replay scores them
    # itself (its weights may differ): equal to float32 rounding, which Adam at lr 0.05
    # grows step by step
    for ours, theirs in zip(_rows(out), _rows(saved), strict=True):
        assert {k: ours.get(k) for k in ROLLOUT} == {k: theirs.get(k) for k in ROLLOUT}
        rel = 1e-4 if ours["step"] == 1 else 1e-2
        for key in ("train/loss", "train/grad_norm", "train/kept_groups", "train/tokens"):
            if theirs.get(key) is None:  # a step with no token to train on logs no loss
                assert ours.get(key) is None, key
                continue
            assert ours[key] == pytest.approx(theirs[key], rel=rel), key
    assert any(row.get("train/loss") is not None for row in _rows(saved))  # it trained


def test_a_replay_with_another_learning_rate_trains_on_the_same_episodes(saved, tmp_path):
    out = tmp_path / "replay"
    _run(out, "--replay", str(saved), "--set", "train.lr=0.0005")
    rows, theirs = _rows(out), _rows(saved)
    # sampled anew, steps 2 and 3 would follow the other weights; replayed, they are the
    # saved episodes, while the update differs
    for ours, saved_row in zip(rows, theirs, strict=True):
        assert {k: ours.get(k) for k in ROLLOUT} == {k: saved_row.get(k) for k in ROLLOUT}
    assert rows[1]["train/loss"] != pytest.approx(theirs[1]["train/loss"], rel=1e-3)
    assert f"replay: {saved}" in (out / "config.yaml").read_text()  # recorded with the run


def test_replay_refuses_what_does_not_fit(saved, tmp_path):
    result = _run(tmp_path / "a", "--replay", str(saved), "--set", "train.steps=5", code=2)
    assert "no saved rollouts for step 4 (3 steps saved" in result.stderr
    assert not (tmp_path / "a").exists()
    result = _run(tmp_path / "b", "--replay", str(saved), "--set", "model.tool_format=llama3",
                  code=2)  # fmt: skip
    assert "tokenized with model.tool_format=" in result.stderr
    result = _run(tmp_path / "c", "--replay", str(tmp_path), code=2)
    assert "not a run folder" in result.stderr
