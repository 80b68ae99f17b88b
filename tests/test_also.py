"""eval.also: other envs evaluated before and after training on fixed seeds: the files
and their episodes, the report's "Did anything else change?" row, `looprl compare`'s
paired row, a resumed run that keeps its baseline, the `training lowered KEY` warning on
hand-made results, and an unknown env name refused at config load with a suggestion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import make_env
from looprl.report.also import also_rows, also_warnings, lowered_line
from looprl.report.stats import paired_stats, reward_with_ci
from tests.run_flags import TINY_RUN, set_flags

TINY = set_flags(*TINY_RUN, "train.checkpoint_every=1")
# an env the run does not train on, with its own label; 3 tasks × 2 samples
ALSO = ["--set", "eval.also=[{name: tictactoe-game, tasks: 3, label: game}]"]


def _run(out: Path, *args: str):
    result = CliRunner().invoke(app, ["run", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result


def _also(run: Path, name: str) -> dict:
    return json.loads((run / "eval" / "also" / "game" / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("also") / "run"
    _run(out, *TINY, *ALSO, "--set", "train.steps=1")
    return out


def test_each_entry_plays_its_fixed_tasks_before_and_after(run):
    """n = tasks × samples_per_task, the task ids the env draws with eval.seed, the same
    before and after; transcripts beside them."""
    expected = [t.id for t in make_env("tictactoe-game").tasks("eval", n=3, seed=1234)]
    for name in ("baseline", "final"):
        result = _also(run, name)
        assert result["env"] == "tictactoe-game" and result["n"] == 6
        assert result["task_seed"] == 1234
        assert result["task_ids"] == [i for i in expected for _ in range(2)]
        lines = (run / "samples" / "also" / "game" / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 6
    main = json.loads((run / "eval" / "baseline.json").read_text())
    assert main["env"] == "tictactoe-move" and main["n"] == 4  # the main eval is its own


def test_the_report_has_one_paired_row_per_entry(run):
    before, after = _also(run, "baseline"), _also(run, "final")
    paired = paired_stats(before, after)
    assert not isinstance(paired, str)
    report = (run / "report.md").read_text()
    assert "## Did anything else change?" in report
    row = next(line for line in report.splitlines() if line.startswith("| game |"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells == [
        "game",
        "tictactoe-game",
        "6",
        reward_with_ci(before),
        reward_with_ci(after),
        f"{paired.mean:+.3f} [95% CI {paired.lo:+.3f}, {paired.hi:+.3f}]",
        f"{paired.better} / {paired.same} / {paired.worse}",
    ]


def test_compare_pairs_the_entries_of_both_runs(run, tmp_path):
    other = tmp_path / "other"
    _run(other, *TINY, *ALSO, "--set", "train.steps=1", "--set", "train.lr=0.05")
    result = CliRunner().invoke(app, ["compare", str(run), str(other), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "compare.md").read_text()
    first, second = _also(run, "final"), _also(other, "final")
    paired = paired_stats(first, second)
    assert not isinstance(paired, str)
    label = "game (eval.also), final"
    row = next(line for line in md.splitlines() if line.startswith(f"| {label} | other |"))
    assert f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]" in row
    assert reward_with_ci(second) in row
    assert f"| {label} | run | 6 | {reward_with_ci(first)} | (reference) |" in md


def test_a_resumed_run_keeps_the_baseline_it_saved(tmp_path):
    out = tmp_path / "run"
    _run(out, *TINY, *ALSO, "--set", "train.steps=1")
    kept = out / "eval" / "also" / "game" / "baseline.json"
    marked = {**json.loads(kept.read_text()), "kept": True}  # a mark a replay would lose
    kept.write_text(json.dumps(marked))
    result = _run(out, "--resume", "--set", "train.steps=2")
    assert json.loads(kept.read_text()) == marked
    assert "eval.also game baseline: kept" in result.stderr
    assert _also(out, "final")["task_ids"] == marked["task_ids"]


def _result(rewards: list[float]) -> dict:
    ids = [f"t{i // 2}" for i in range(len(rewards))]
    mean = sum(rewards) / len(rewards)
    return {
        "env": "x",
        "n": len(rewards),
        "rewards": rewards,
        "task_ids": ids,
        "reward_mean": mean,
        "reward_ci95": [mean - 0.1, mean + 0.1],
    }


def test_a_fall_whose_interval_excludes_zero_is_warned_on(tmp_path):
    before = _result([1.0] * 16)
    fell, mixed = _result([0.0] * 16), _result([1.0, 0.0] * 8)
    rose = _result([1.0] * 16)
    assert lowered_line("game", before, fell).startswith("training lowered game: ")
    assert lowered_line("game", before, rose) is None  # no change
    assert lowered_line("game", _result([0.0, 1.0] * 8), mixed) is None  # CI spans zero
    # the same from files, as the report and the run's closing lines read them
    for key, (b, a) in {"fell": (before, fell), "same": (before, rose)}.items():
        folder = tmp_path / "eval" / "also" / key
        folder.mkdir(parents=True)
        (folder / "baseline.json").write_text(json.dumps(b))
        (folder / "final.json").write_text(json.dumps(a))
    warned = also_warnings(tmp_path)
    assert len(warned) == 1 and warned[0].startswith("training lowered fell: ")
    assert "-1.000 [95% CI -1.000, -1.000]" in warned[0]
    assert [row[0] for row in also_rows(tmp_path)] == ["fell", "same"]


def test_an_entry_whose_replies_would_be_cut_is_refused_before_anything_is_written(tmp_path):
    """Its episodes share rollout.max_new_tokens with the run's: extraction's records need
    more than 48 tokens."""
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run",
            *TINY,
            "--set",
            "rollout.max_new_tokens=48",
            "--set",
            "eval.also=[{name: extraction, label: records}]",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "eval.also[0] (records): rollout.max_new_tokens=48 is below" in result.output
    assert not out.exists()


def test_an_unknown_env_name_is_refused_at_load_with_a_suggestion(tmp_path):
    result = CliRunner().invoke(
        app,
        ["config", "show", "--set", "eval.also=[{name: tictactoe-gam}]"],
    )
    assert result.exit_code == 2
    assert "eval.also[0].name" in result.output
    assert "did you mean 'tictactoe-game'?" in result.output
    repeated = CliRunner().invoke(
        app, ["config", "show", "--set", "eval.also=[{name: extraction}, {name: extraction}]"]
    )
    assert repeated.exit_code == 2 and "repeated: extraction" in repeated.output
