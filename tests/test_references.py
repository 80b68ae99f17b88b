"""Reference rows: `looprl eval --endpoint` plays an env's held-out episodes against an
OpenAI-compatible endpoint (here the real `looprl serve` app over HTTP, through the
official client), resumes after a crash, and a run's report pairs the trained model
against it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.cli import app

EVAL = ["--set", "env.name=tests.toy_envs:PickSeven", "--set", "eval.tasks=3",
        "--set", "eval.samples_per_task=2", "--set", "rollout.max_new_tokens=32"]  # fmt: skip


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(create_app(load_chat_model("tiny-random", device="cpu"))) as base:
        yield f"{base}/v1"


def reference(runner: CliRunner, url: str, out: Path, *extra: str):
    args = ["eval", *EVAL, *extra, "--endpoint", url, "--model", "tiny-random", "--out", str(out)]
    return runner.invoke(app, args)


def test_an_endpoint_is_evaluated_and_resumed(url, tmp_path):
    runner, out = CliRunner(), tmp_path / "ref.json"
    res = reference(runner, url, out)
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["endpoint"] == url and result["model"] == "tiny-random" and result["n"] == 6
    assert result["response_len"] > 0  # the endpoint's own token counts
    assert set(result["episode_outcomes"]) <= {"hit", "miss", "truncated", "bad_json",
                                               "bad_arguments", "no_tool_call"}  # fmt: skip
    assert len(result["task_ids"]) == 6 and result["task_ids"][0] == result["task_ids"][1]
    log = out.with_suffix(".episodes.jsonl")
    lines = log.read_text().splitlines()
    assert len(lines) == 6 and {json.loads(x)["index"] for x in lines} == set(range(6))
    # a crash after two episodes: the rerun asks only for the four others
    log.write_text("\n".join(lines[:2]) + "\n")
    out.unlink()
    res = reference(runner, url, out)
    assert res.exit_code == 0, res.output
    assert len(log.read_text().splitlines()) == 6 and "(2 kept)" in res.output
    assert json.loads(out.read_text())["n"] == 6


def test_an_unreachable_endpoint_is_a_clear_error(tmp_path):
    res = reference(CliRunner(), "http://127.0.0.1:9/v1", tmp_path / "ref.json")
    assert res.exit_code == 2 and "the endpoint refused or failed a request" in res.stderr


def test_a_run_reports_the_reference_row_paired_with_the_trained_model(url, tmp_path):
    runner, ref = CliRunner(), tmp_path / "ref.json"
    assert reference(runner, url, ref).exit_code == 0
    run = ["run", *EVAL, "--set", "model.name=tiny-random", "--set", "train.steps=1",
           "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
           "--set", f"eval.references=[{ref}]"]  # fmt: skip
    res = runner.invoke(app, [*run, "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert "reference tiny-random: " in res.stdout
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Reference models" in report and "trained − tiny-random" in report
    # a reference of other episodes is refused before anything is written
    res = runner.invoke(app, [*run, "--set", "eval.tasks=2", "--out", str(tmp_path / "other")])
    assert res.exit_code == 2 and "did not play this run's held-out episodes" in res.stderr
    assert not (tmp_path / "other").exists()
