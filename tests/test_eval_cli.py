"""`looprl eval` of a local model on the tiny model: the summary it prints, `--json`,
and what `--out` keeps (the EvalResult and each episode, in the endpoint eval's format)."""

from __future__ import annotations

import json
from collections import Counter

from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import make_env
from looprl.loop.remote import _kept

EVAL = ["--set", "model.name=tiny-random", "--set", "env.name=tests.toy_envs:PickSeven",
        "--set", "eval.tasks=3", "--set", "eval.samples_per_task=2",
        "--set", "rollout.max_new_tokens=40"]  # fmt: skip


def test_a_local_eval_prints_a_summary_and_keeps_its_episodes(tmp_path):
    out = tmp_path / "evals" / "base.json"
    res = CliRunner().invoke(app, ["eval", *EVAL, "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    lo, hi = result["reward_ci95"]
    counts = Counter(result["episode_outcomes"])
    assert res.stdout.splitlines() == [
        "tests.toy_envs:PickSeven, tiny-random: 6 episodes",
        f"reward, mean [95% CI]: {result['reward_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]",
        "outcomes: " + " · ".join(f"{label} {n}" for label, n in counts.most_common()),
        f"wrote {out} (EvalResult) and {tmp_path / 'evals' / 'base.episodes.jsonl'} (episodes)",
    ]
    assert sum(counts.values()) == 6
    # each episode, in play order, as an endpoint eval writes them
    records = [json.loads(x) for x in out.with_suffix(".episodes.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(6))
    assert [r["reward"] for r in records] == result["rewards"]
    assert [r["outcome"] for r in records] == result["episode_outcomes"]
    assert [r["task_id"] for r in records] == result["task_ids"]
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    # the endpoint eval's own reader takes every one of them as a finished episode
    tasks = make_env("tests.toy_envs:PickSeven", {}).tasks("eval", n=3, seed=result["task_seed"])
    assert sorted(_kept(out.with_suffix(".episodes.jsonl"), [t for t in tasks for _ in "ab"])) == [
        0, 1, 2, 3, 4, 5,
    ]  # fmt: skip
    # the progress, on stderr: a count line as episodes end (the time left once a quarter
    # of them have: the first few of a batch say nothing of the pace)
    counted = [x for x in res.stderr.splitlines() if x.startswith("  eval · ")]
    assert counted[0] == "  eval · 1/6 episodes" and counted[-1] == "  eval · 6/6 episodes"


def test_json_prints_the_whole_eval_result_and_no_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["eval", *EVAL, "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert result["n"] == 6 and len(result["rewards"]) == 6
    assert list(tmp_path.iterdir()) == []
    res = CliRunner().invoke(app, ["eval", *EVAL, "--set", "eval.tasks=1"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1] == (
        "nothing written: --out FILE.json keeps the EvalResult and each episode"
    )


def test_out_a_folder_is_refused_before_the_model_loads(tmp_path):
    res = CliRunner().invoke(app, ["eval", *EVAL, "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert f"--out {tmp_path} is a folder; give a file, e.g. --out {tmp_path / 'eval.json'}" in (
        res.stderr
    )
    assert "load model" not in res.stderr and list(tmp_path.iterdir()) == []


def test_an_endpoint_eval_will_not_resume_from_a_local_eval(tmp_path):
    """A local eval's episodes beside --out are not the endpoint's: a rerun that kept them
    would report the local model's episodes under the endpoint's name."""
    out = tmp_path / "base.json"
    res = CliRunner().invoke(app, ["eval", *EVAL, "--set", "eval.tasks=1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    before = out.read_text(), out.with_suffix(".episodes.jsonl").read_text()
    url = "http://127.0.0.1:9/v1"
    res = CliRunner().invoke(
        app, ["eval", *EVAL, "--endpoint", url, "--model", "gpt-x", "--out", str(out)]
    )
    assert res.exit_code == 2
    assert f"hold an eval of tiny-random (a local model), not of gpt-x at {url}" in res.stderr
    assert (out.read_text(), out.with_suffix(".episodes.jsonl").read_text()) == before
