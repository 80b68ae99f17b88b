"""The `judge` scorer against a real endpoint (`looprl serve` of the tiny model, over HTTP,
through the official client): verdicts under a JSON schema, cached by content, retried and
then a counted env_error (never a silent 0), and a judged data file trained end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.cli import app
from looprl.envs import make_env
from looprl.envs.data.scorers import make_scorers
from looprl.errors import EnvError
from looprl.types import Message

RUBRIC = "1 if the reply greets the person by name, else 0."


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(create_app(load_chat_model("tiny-random", device="cpu"))) as base:
        yield f"{base}/v1"


def judge_spec(url: str, **extra) -> dict:
    return {"name": "judge", "rubric": RUBRIC, "endpoint": url, "model": "tiny-random", **extra}


def test_a_verdict_is_a_score_in_range_and_cached_by_content(url):
    (judge,) = make_scorers(judge_spec(url))
    row = {"prompt_text": "Greet Ana."}
    first = judge("Hello Ana!", None, row)
    assert first.value in [i / 10 for i in range(11)] and judge.fn.last["calls"] >= 1
    assert not judge.fn.last["cached"] and isinstance(judge.fn.last["reason"], str)
    again = judge("Hello Ana!", None, row)
    assert again.value == first.value and judge.fn.last == {**judge.fn.last, "cached": True,
                                                             "calls": 0}  # fmt: skip
    judge("Hello Bo!", None, row)
    assert not judge.fn.last["cached"]  # another reply is another verdict


def test_a_judge_that_keeps_failing_raises_after_its_retries():
    (judge,) = make_scorers(judge_spec("http://127.0.0.1:9/v1", retries=1))
    with pytest.raises(EnvError, match="failed 2 times"):
        judge("Hello", None, {"prompt_text": "Greet Ana."})


@pytest.mark.parametrize(
    ("spec", "needle"),
    [({"name": "judge", "endpoint": "http://x/v1", "model": "m"}, "needs rubric"),
     ({"name": "judge", "rubric": "r", "model": "m", "endpoint": "http://x/v1", "temp": 1},
      "bad arguments")],
)  # fmt: skip
def test_bad_judge_config_is_clear(spec, needle):
    with pytest.raises(EnvError, match=needle):
        make_scorers(spec)


def test_a_judged_data_file_is_not_judged_row_by_row_up_front(tmp_path):
    rows = [{"prompt": f"Greet person {i}."} for i in range(6)]
    path = tmp_path / "greet.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # an unreachable judge: building the env asks it nothing (rows have no answer to score)
    env = make_env(
        "dataset",
        {
            "path": str(path),
            "eval_fraction": 0.5,
            "scorers": judge_spec("http://127.0.0.1:9/v1", retries=0),
        },
    )
    assert "partial" in env.outcomes and len(env.tasks("eval")) == 3
    task = env.tasks("eval")[0]
    env.reset(task)
    with pytest.raises(EnvError, match="the judge"):
        env.step(Message("assistant", "Hi"))


def judged_run(tmp_path: Path, scorers: list, group_size: int, samples: int) -> Path:
    """`looprl run` on greetings to write, judged by `scorers`; returns the run folder. The
    reply is a short JSON object (forced by its schema), which always ends within the token
    limit, so the judge is asked about every episode."""
    rows = [{"prompt": f"Greet person number {i}."} for i in range(8)]
    data = tmp_path / "greet.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 8}},
              "required": ["greeting"], "additionalProperties": False}  # fmt: skip
    config = {"env": {"name": "dataset", "args": {
                  "path": str(data), "eval_fraction": 0.25, "answer_form": "json",
                  "response_schema": schema, "scorers": scorers}},
              "model": {"name": "tiny-random"}, "train": {"steps": 1},
              "rollout": {"tasks_per_step": 2, "group_size": group_size, "max_new_tokens": 48},
              "eval": {"tasks": 2, "samples_per_task": samples, "greedy": False}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "run.yaml"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_a_judged_run_trains_and_logs_its_calls(url, tmp_path: Path):
    out = judged_run(tmp_path, [judge_spec(url)], group_size=2, samples=1)
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step.get("outcomes/truncated", 0.0) == 0.0
    assert step["judge/calls"] >= 1 and step["judge/seconds"] > 0
    assert 0.0 <= step["scores/judge"] <= 1.0
    lines = (out / "judge_cache.jsonl").read_text().splitlines()
    verdicts = [json.loads(x)["verdict"] for x in lines]
    assert verdicts and all(isinstance(v["score"], int | float) for v in verdicts)
    final = json.loads((out / "eval" / "final.json").read_text())
    assert final["judge"]["seconds"] >= 0 and "judge" in final["scores"]


def test_a_group_judge_scores_a_task_s_replies_together(url):
    (judge,) = make_scorers(judge_spec(url, mode="group"))
    assert judge.group and judge.remote
    values = judge.fn.rank("Greet Ana.", None, ["Hi Ana", "Hello", "Dear Ana, hello!"])
    assert len(values) == 3 and all(v in [i / 10 for i in range(11)] for v in values)
    assert judge.fn.rank("Greet Ana.", None, ["Hi Ana", "Hello", "Dear Ana, hello!"]) == values
    assert judge.fn.last["cached"]
    with pytest.raises(EnvError, match="mode='ranked'"):
        make_scorers(judge_spec(url, mode="ranked"))


def test_a_group_judged_run_fills_every_score(url, tmp_path: Path):
    scorers = [judge_spec(url, mode="group", weight=3), "tests.toy_envs:half_scorer"]
    out = judged_run(tmp_path, scorers, group_size=3, samples=2)
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["judge/calls"] >= 2  # one request a group: 2 tasks
    records = [json.loads(x) for x in (out / "samples" / "final.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for r in records:
        assert "pending_group" not in r["info"] and r["info"]["labels"]["judge"] != "pending"
        assert r["reward"] == pytest.approx((3 * r["info"]["scores"]["judge"] + 0.5) / 4)
