"""`looprl compare`: real tiny runs on the same held-out episodes paired against the first,
their config differences and overlaid curves; runs that did not play the same episodes,
folders that are not runs and unfinished runs refused with exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.report.compare import episode_difference
from looprl.report.compare_plots import HELD_OUT_PLOT, TRAINING_PLOT
from looprl.report.compare_read import flatten
from looprl.report.stats import paired_stats, reward_with_ci

TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=2", "--set", "eval.tasks=3",
        "--set", "eval.samples_per_task=2", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]", "--set", "train.steps=2"]  # fmt: skip


def _run(out: Path, *args: str) -> Path:
    result = CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _compare(*args: str):
    return CliRunner().invoke(app, ["compare", *args])


def _eval(run: Path, name: str) -> dict:
    return json.loads((run / "eval" / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """a: GSPO with a held-out curve; b: GRPO sampling from the top 3 tokens with large
    steps, which plays the same episodes with other rewards; seed/tasks: a's settings but
    other held-out episodes."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "a": _run(root / "a", "--set", "eval.every=1"),
        "b": _run(
            root / "b",
            "--set",
            "algo.name=grpo",
            "--set",
            "rollout.top_k=3",
            "--set",
            "train.lr=0.5",
        ),  # a step large enough to change its play
        "seed": _run(root / "seed", "--set", "eval.seed=99", "--set", "train.steps=1"),
        "tasks": _run(root / "tasks", "--set", "eval.tasks=2", "--set", "train.steps=1"),
    }


def _table_row(md: str, *first_cells: str) -> list[str]:
    """The cells of the Markdown table row starting with `first_cells`."""
    prefix = "| " + " | ".join(first_cells) + " |"
    rows = [line for line in md.splitlines() if line.startswith(prefix)]
    assert len(rows) == 1, (prefix, md)
    return [cell.strip() for cell in rows[0].strip("|").split(" | ")]


@pytest.mark.slow  # the module's four tiny training runs
def test_each_run_is_paired_against_the_first_on_the_same_episodes(runs, tmp_path):
    out = tmp_path / "cmp"
    result = _compare(str(runs["a"]), str(runs["b"]), "--out", str(out))
    assert result.exit_code == 0, result.output
    md = (out / "compare.md").read_text()
    for name in ("baseline", "final"):
        first, other = _eval(runs["a"], name), _eval(runs["b"], name)
        paired = paired_stats(first, other)  # by hand, from the two files
        assert not isinstance(paired, str)
        assert _table_row(md, name, "a") == [name, "a", "6", reward_with_ci(first),
                                             "(reference)", "-"]  # fmt: skip
        assert _table_row(md, name, "b") == [
            name, "b", "6", reward_with_ci(other),
            f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]",
            f"{paired.better} / {paired.same} / {paired.worse}",
        ]  # fmt: skip
    final_a, final_b = _eval(runs["a"], "final"), _eval(runs["b"], "final")
    assert final_a["rewards"] != final_b["rewards"], "the runs must differ to test the pairing"
    # the baselines differ on the same episodes: said in one line
    assert "The baselines' rewards differ (b against a)" in md
    # per outcome: each run's share of its final episodes and b's difference to a's
    shares_a, shares_b = (Counter(f["episode_outcomes"]) for f in (final_a, final_b))
    for label in set(shares_a) | set(shares_b):
        share_a, share_b = shares_a[label] / 6, shares_b[label] / 6
        assert _table_row(md, label) == [
            label, f"{share_a:.0%}", f"{share_b:.0%} ({100 * (share_b - share_a):+.0f} pp)"
        ]  # fmt: skip
    # reversed, the difference changes sign: the first run is the reference
    again = tmp_path / "reversed"
    assert _compare(str(runs["b"]), str(runs["a"]), "--out", str(again)).exit_code == 0
    paired = paired_stats(final_b, final_a)
    assert f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]" in _table_row(
        (again / "compare.md").read_text(), "final", "a"
    )


@pytest.mark.slow
def test_the_config_differences_and_the_curves(runs, tmp_path):
    out = tmp_path / "cmp"
    assert _compare(str(runs["a"]), str(runs["b"]), "--out", str(out)).exit_code == 0
    md = (out / "compare.md").read_text()
    assert _table_row(md, "algo.name") == ["algo.name", "gspo", "grpo"]
    assert _table_row(md, "rollout.top_k") == ["rollout.top_k", "0", "3"]
    assert _table_row(md, "eval.every") == ["eval.every", "1", "0"]
    assert _table_row(md, "train.lr")[2] == "0.5"
    assert "| model.name |" not in md and "| train.steps |" not in md  # equal: not listed
    assert _table_row(md, "a")[2:] == ["tiny-random", "tictactoe-move", "gspo", "2 of 2"]
    for name in (TRAINING_PLOT, HELD_OUT_PLOT):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](plots/{name})" in md
    assert "(b: no curve, eval.every was off)" in md
    page = (out / "compare.html").read_text()
    assert "default-src 'none'" in page  # the CSP: nothing fetched, no script runs
    assert page.count('src="data:image/png;base64,') == 2
    assert "<script" not in page and "http://" not in page and "https://" not in page


@pytest.mark.slow
def test_without_curves_or_differences_and_an_eval_only_one_run_has(runs, tmp_path):
    out = tmp_path / "cmp"
    (out / "plots").mkdir(parents=True)
    (out / "plots" / HELD_OUT_PLOT).write_bytes(b"stale")  # from an earlier comparison
    twin = tmp_path / "b2"
    shutil.copytree(runs["b"], twin)
    shutil.copy(twin / "eval" / "final.json", twin / "eval" / "final_greedy.json")
    assert _compare(str(runs["b"]), str(twin), "--out", str(out)).exit_code == 0
    md = (out / "compare.md").read_text()
    # an eval only the second run has: its own numbers, nothing to pair with
    greedy = "final, greedy (T = 0)"
    assert _table_row(md, greedy, "b")[3] == "no eval/final_greedy.json"
    assert _table_row(md, greedy, "b2")[3:] == [
        reward_with_ci(_eval(twin, "final")), "not paired: b has no eval/final_greedy.json", "-"
    ]  # fmt: skip
    assert not (out / "plots" / HELD_OUT_PLOT).exists() and "Held-out curves" not in md
    assert "The runs' config.yaml files hold the same values." in md
    assert "rewards differ" not in md


@pytest.mark.slow
@pytest.mark.parametrize(
    ("other", "reason"),
    [("seed", "a different eval seed (task seed 99 instead of 1234)"),
     ("tasks", "a different number of episodes (4 instead of 6)")],
)  # fmt: skip
def test_runs_on_other_held_out_episodes_are_refused(runs, tmp_path, other, reason):
    out = tmp_path / "cmp"
    result = _compare(str(runs["a"]), str(runs[other]), "--out", str(out))
    assert result.exit_code == 2, result.output
    assert f"{runs[other]} played {reason}" in " ".join(result.output.split())
    assert not out.exists()


@pytest.mark.slow
def test_a_folder_that_is_not_a_run_an_unfinished_run_and_one_run_are_refused(runs, tmp_path):
    out = tmp_path / "cmp"
    result = _compare(str(runs["a"]), str(tmp_path), "--out", str(out))
    assert result.exit_code == 2 and "is not a run folder (no config.yaml)" in result.output
    stopped = tmp_path / "stopped"
    shutil.copytree(runs["b"], stopped)
    (stopped / "eval" / "final.json").unlink()  # as a run stopped before its final eval
    result = _compare(str(runs["a"]), str(stopped), "--out", str(out))
    assert result.exit_code == 2, result.output
    assert "has no eval/final.json" in " ".join(result.output.split())
    result = _compare(str(runs["a"]), "--out", str(out))
    assert result.exit_code == 2 and "at least two run folders" in result.output
    assert not out.exists()


# ---------------------------------------------------------------- the check alone

BASE = {"env": "tictactoe-move", "task_ids": ["t1", "t1", "t2", "t2"], "task_seed": 1,
        "temperature": 1.0, "rewards": [0.0, 1.0, 0.0, 1.0]}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "reason"),
    [({}, None),
     ({"rewards": [1.0, 1.0, 1.0, 1.0]}, None),  # other rewards: still paired
     ({"env": "tictactoe"}, "a different env (tictactoe instead of tictactoe-move)"),
     ({"task_ids": ["t1", "t1"]}, "a different number of episodes (2 instead of 4)"),
     ({"task_seed": 2}, "a different eval seed (task seed 2 instead of 1)"),
     ({"task_ids": ["t1", "t1", "t3", "t3"]}, "different task ids (2 of 4 episodes play "
                                              "another task)"),
     ({"task_ids": ["t2", "t2", "t1", "t1"]}, "different task ids (4 of 4 episodes play "
                                              "another task)"),  # the same tasks, reordered
     ({"temperature": 0.7}, "a different eval temperature (0.7 instead of 1.0)")],
)  # fmt: skip
def test_episode_difference_names_how_two_baselines_differ(change, reason):
    assert episode_difference(BASE, {**BASE, **change}) == reason


def test_flatten_gives_dotted_keys_and_keeps_lists_whole():
    tree = {"train": {"lr": 0.1, "steps": 2}, "env": {"args": {}, "mix": [1, 2]}, "seed": 0}
    assert flatten(tree) == {"train.lr": 0.1, "train.steps": 2, "env.args": {},
                             "env.mix": [1, 2], "seed": 0}  # fmt: skip
