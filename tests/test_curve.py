"""eval.every: the held-out curve at step 0 and every N steps, the best step's weights,
and a resumed run that keeps its points."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from looprl.cli import app

TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=2", "--set", "eval.tasks=3",
        "--set", "eval.samples_per_task=2", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]", "--set", "train.lr=0.05"]  # fmt: skip


def _run(out: Path, *args: str):
    result = CliRunner().invoke(app, ["run", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result


def _curve(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "eval" / "curve.jsonl").read_text().splitlines()]


def _eval(out: Path, name: str) -> dict:
    return json.loads((out / "eval" / f"{name}.json").read_text())


def test_every_held_out_task_on_the_curve_reuses_the_evals_before_and_after(tmp_path):
    out = tmp_path / "run"
    result = _run(out, *TINY, "--set", "train.steps=3", "--set", "eval.every=2")
    curve = _curve(out)
    assert [r["step"] for r in curve] == [0, 2, 3]
    for row, name in ((curve[0], "baseline"), (curve[-1], "final")):
        assert row["rewards"] == _eval(out, name)["rewards"]
        assert row["task_ids"] == _eval(out, name)["task_ids"]
    assert curve[1]["task_ids"] == curve[0]["task_ids"] and curve[1]["n"] == 6  # same tasks
    best = max(curve, key=lambda r: r["reward_mean"])
    meta = json.loads((out / "checkpoints" / "best" / "meta.json").read_text())
    assert meta["step"] == best["step"] and meta["reward_mean"] == best["reward_mean"]
    assert (out / "checkpoints" / "best" / "trainable.safetensors").exists()
    assert f"held-out curve: best at step {best['step']}" in result.stderr


def test_a_subset_curve_measures_its_own_points_and_the_best_weights_load(tmp_path):
    out = tmp_path / "run"
    _run(out, *TINY, "--set", "train.steps=3", "--set", "eval.every=2",
         "--set", "eval.curve_tasks=1")  # fmt: skip
    curve = _curve(out)
    assert [r["step"] for r in curve] == [0, 2, 3]  # the last step measured in the loop
    assert all(r["n"] == 2 and len(set(r["task_ids"])) == 1 for r in curve)
    # the best step's weights are a checkpoint like any other: `looprl eval` loads them
    evaluated = tmp_path / "best.json"
    result = CliRunner().invoke(app, ["eval", str(out / "config.yaml"), "--checkpoint",
                                      str(out / "checkpoints" / "best"), "--out",
                                      str(evaluated)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(evaluated.read_text())["n"] == 6


def test_a_resumed_run_keeps_its_points(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--set", "eval.every=1", "--set", "train.checkpoint_every=1"]
    _run(out, *args, "--set", "train.steps=2")
    first = _curve(out)
    assert [r["step"] for r in first] == [0, 1, 2]
    _run(out, "--resume", "--set", "train.steps=4")
    curve = _curve(out)
    assert [r["step"] for r in curve] == [0, 1, 2, 3, 4]
    assert curve[:2] == first[:2]  # kept, not measured again


def test_the_report_draws_the_curve_and_names_the_best_step(tmp_path):
    out = tmp_path / "run"
    _run(out, *TINY, "--set", "train.steps=2", "--set", "eval.every=1")
    best = max(_curve(out), key=lambda r: r["reward_mean"])
    report = (out / "report.md").read_text()
    assert "## Held-out curve" in report
    assert f"Best at step {best['step']}: {best['reward_mean']:+.3f}" in report
    assert "(plots/held_out_curve.png)" in report
    assert (out / "plots" / "held_out_curve.png").stat().st_size > 1000
    # a run without eval.every has no such section
    plain = tmp_path / "plain"
    _run(plain, *TINY, "--set", "train.steps=1")
    assert "Held-out curve" not in (plain / "report.md").read_text()
