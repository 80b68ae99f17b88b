"""The `dataset` env and its scorers (unit), and the guard rails a user's first run meets,
through the real CLI on the tiny model: a data file trains, every mistake is one message
with exit 2 and nothing written, or a counted, reported outcome."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import make_env
from looprl.envs.check import check_env
from looprl.envs.data.scorers import make_scorers
from looprl.errors import EnvError
from looprl.types import Message, ToolCall

BOOKINGS = Path(__file__).parent.parent / "examples" / "bookings"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1"]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(n: int = 10) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def call_rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"Weather in city {i} for {i % 3 + 1} days",
             "answer": {"city": f"city {i}", "days": i % 3 + 1}} for i in range(n)]  # fmt: skip


# ------------------------------------------------------------------------------ scorers


@pytest.mark.parametrize(
    ("spec", "response", "answer", "value"),
    [
        ("exact", " 42 ", "42", 1.0),
        ("exact", "42.", "42", 0.0),
        ("normalized", "The  ANSWER: Paris!", "the answer paris", 1.0),
        ({"name": "numeric", "tolerance": 0.01}, "so it is 3,141.004 then", "3141", 1.0),
        ("numeric", "no number here", "7", 0.0),
        ({"name": "regex", "pattern": r"\d{4}-\d{2}"}, "on 2027-03", None, 1.0),
        ({"name": "regex", "fullmatch": True}, "abc", "a.c", 1.0),
        ("contains", "I think it is New York.", "new york", 1.0),
        ("json_fields", {"a": 1, "b": "X"}, {"a": 1.0, "b": "x"}, 1.0),
        ("json_fields", {"a": 1, "b": "y"}, {"a": 1, "b": "x"}, 0.5),
        ("json_fields", {"a": 1, "b": "x", "c": 3}, {"a": 1, "b": "x"}, 0.8),
        ({"name": "json_fields", "all_fields": True}, {"a": 1}, {"a": 1, "b": 2}, 0.0),
        ("tool_call", {"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 1}},
         1.0),
        ("tool_call", {"name": "g", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 1}},
         0.0),
        ("tests.toy_envs:half_scorer", "anything", None, 0.5),
    ],
)  # fmt: skip
def test_each_scorer(spec, response, answer, value):
    (scorer,) = make_scorers(spec)
    score = scorer(response, answer, {})
    assert score.value == pytest.approx(value)
    assert score.label == ("correct" if value == 1 else "wrong" if value == 0 else "partial")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("exactly", "unknown scorer 'exactly'; known: exact, normalized"),
        ([], "scorers is empty"),
        ({"name": "exact", "weight": 0}, "weight=0 must be a number above 0"),
        ({"name": "numeric", "tolerence": 1}, "bad arguments"),
        ({"name": "regex", "pattern": "(unclosed"}, "does not compile"),
        ("tests.toy_envs:no_such", "has no attribute 'no_such'"),
        ("no_such_module:f", "cannot import scorer module"),
    ],
)
def test_bad_scorers_are_clear_errors(spec, needle):
    with pytest.raises(EnvError, match=None) as err:
        make_scorers(spec)
    assert needle in str(err.value)


def test_a_scorer_outside_0_1_is_an_error():
    (scorer,) = make_scorers("tests.toy_envs:length_scorer")
    assert scorer("abc", None, {"length": 3}).value == 1.0
    (bad,) = make_scorers({"name": "tests.toy_envs:half_scorer"})
    bad.fn = lambda *a: 3.0
    with pytest.raises(EnvError, match="returned 3.0"):
        bad("x", None, {})


# ------------------------------------------------------------------------------ the env


def test_text_rows_split_by_content_and_score_by_weights(tmp_path):
    rows = qa_rows(10)
    rows.append(dict(rows[0]))  # the same prompt twice: never on both sides of the split
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    spec = ["normalized", {"name": "numeric", "weight": 3}]
    env = make_env("dataset", {"path": str(path), "eval_fraction": 0.3, "scorers": spec})
    train = {json.dumps(t.data["messages"]) for t in env.tasks("train", n=50, seed=1)}
    held = {json.dumps(t.data["messages"]) for t in env.tasks("eval")}
    assert held and train and not held & train
    assert env.tasks("eval", n=100) == env.tasks("eval")  # never more than there are
    task = env.tasks("eval")[0]
    obs = env.reset(task)
    assert obs.tools == [] and obs.messages[-1].content == task.data["messages"][-1]["content"]
    result = env.step(Message("assistant", f"It is {task.data['answer']}, I think"))
    assert result.reward == pytest.approx(0.75) and result.outcome == "partial"
    assert result.info["scores"] == {"normalized": 0.0, "numeric": 1.0}
    env.reset(task)
    assert env.step(env.demonstrations(task)[0]).outcome == "correct"


def test_tool_call_rows_from_csv_with_per_row_tools(tmp_path):
    path = tmp_path / "calls.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "tools", "gold"])
        writer.writeheader()
        for row in call_rows(6):
            writer.writerow({"question": row["prompt"], "tools": json.dumps([TOOL]),
                             "gold": json.dumps(row["answer"])})  # fmt: skip
    env = make_env("dataset", {
        "path": str(path), "eval_fraction": 0.5,
        "columns": {"prompt": "question", "tools": "tools", "answer": "gold"},
        "system_prompt": "Call lookup.",
    })  # fmt: skip
    assert env.form == "tool_call" and "unknown_tool" in env.outcomes
    task = env.tasks("eval")[0]
    obs = env.reset(task)
    assert obs.tool_choice == "required" and obs.messages[0].role == "system"
    want = task.data["answer"]["arguments"]
    call = ToolCall("lookup", {"city": want["city"], "days": want["days"] + 1})
    result = env.step(Message("assistant", tool_calls=[call]))
    assert result.outcome == "partial" and result.reward == pytest.approx(0.5)
    assert result.info["fields"] == {"city": True, "days": False}
    env.reset(task)
    failed = env.step(Message("assistant", parse_failure="bad_json"))
    assert (failed.outcome, failed.reward) == ("bad_json", -1.0)


def test_json_rows_are_forced_by_the_response_schema(tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rows = [{"prompt": f"n is {i}", "answer": {"n": i}} for i in range(6)]
    env = make_env("dataset", {"path": str(write_jsonl(tmp_path / "j.jsonl", rows)),
                               "answer_form": "json", "response_schema": schema,
                               "eval_fraction": 0.5})  # fmt: skip
    task = env.tasks("eval")[0]
    assert env.reset(task).response_format["json_schema"]["schema"] == schema
    assert env.step(Message("assistant", json.dumps(task.data["answer"]))).outcome == "correct"
    env.reset(task)
    assert env.step(Message("assistant", '{"n": "x"}')).outcome == "bad_arguments"
    env.reset(task)
    assert env.step(Message("assistant", "{oops")).outcome == "bad_json"


def test_parquet_and_a_saved_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = qa_rows(8)
    data = datasets.Dataset.from_list(rows)
    data.to_parquet(str(tmp_path / "qa.parquet"))
    data.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "qa.parquet", tmp_path / "saved"):
        env = make_env("dataset", {"path": str(path), "eval_fraction": 0.25})
        assert len(env.tasks("eval")) == 2 and len(env.rows.train) == 6


@pytest.mark.parametrize(
    ("rows", "args", "needle"),
    [
        ("{bad json\n", {}, "line 1 is not valid JSON"),
        ([{"question": "q", "answer": "a"}] * 3, {},
         "a 'prompt' or 'messages' column is missing from every row; the file's columns: "
         "answer, question"),
        (qa_rows(2) + [{"question": "q", "answer": "a"}], {}, "row 3 has neither a 'prompt' nor"),
        ([{"prompt": "q"}] * 3, {},
         "column 'answer' (the scorer 'normalized' needs it) is missing from every row"),
        (qa_rows(2) + [{"prompt": "q"}], {}, "row 3: field 'answer': missing"),
        (qa_rows(3), {"columns": {"info": "meta"}},
         "column 'meta' (columns maps info to it) is missing from every row"),
        (call_rows(3)[:2] + [{"prompt": "x", "answer": {"city": "c", "days": "two"}}],
         {"tools": [TOOL]}, "row 3: field 'answer': the call does not fit lookup's schema"),
        (call_rows(3), {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]},
         "is not a valid JSON schema"),
        (qa_rows(3), {"scorers": "tests.toy_envs:raising_scorer"},
         "row 1: field 'answer': scoring the row's own answer raised ValueError"),
        (qa_rows(3), {"answer_form": "yaml"}, "answer_form='yaml' is invalid"),
        (qa_rows(3), {"columns": {"question": "q"}}, "columns: unknown names ['question']"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_row_and_field(tmp_path, rows, args, needle):
    path = tmp_path / "rows.jsonl"
    if isinstance(rows, str):
        path.write_text(rows)
    else:
        write_jsonl(path, rows)
    with pytest.raises(EnvError) as err:
        make_env("dataset", {"path": str(path), "eval_fraction": 0.34, **args})
    assert needle in str(err.value)


def test_the_example_passes_the_env_kit():
    args = yaml.safe_load((BOOKINGS / "run.yaml").read_text())["env"]["args"]
    report = check_env("dataset", args, n=16)
    assert report.ok, [(c.name, c.detail) for c in report.checks if not c.ok]


# ------------------------------------------------------------------ through the CLI


@pytest.fixture()
def runner():
    return CliRunner()


def dataset_config(tmp_path: Path, **env_args) -> Path:
    path = write_jsonl(tmp_path / "calls.jsonl", call_rows(8))
    config = {"env": {"name": "dataset", "args": {"path": str(path), "eval_fraction": 0.25,
                                                  "tools": [TOOL], **env_args}},
              "rollout": {"max_new_tokens": 48}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "run.yaml"


def test_a_data_file_trains_and_reports_its_scores(runner, tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", str(dataset_config(tmp_path)), *TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= step["rollout/unscorable"] <= 1.0 for step in steps)
    # a step logs the scores of its scored episodes: none where all were unscorable
    # (every episode cut at the token limit), else the mean over the scored ones
    assert all(("scores/tool_call" in step) == (step["rollout/unscorable"] < 1) for step in steps)
    baseline = json.loads((out / "eval" / "baseline.json").read_text())
    assert baseline["env"] == "dataset" and baseline["solved_outcomes"] == ["correct"]
    records = [json.loads(x) for x in (out / "samples" / "baseline.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    scored = [r for r in records if r["outcome"] not in ("truncated",)]
    assert all("scores" in r["info"] for r in scored)
    truncated = [r for r in records if r["outcome"] == "truncated"]
    assert all(r["reward"] == -1.0 and "token limit" in r["info"]["truncated"] for r in truncated)
    if truncated:  # the eval's console line counts them
        assert f"{len(truncated)} truncated at the token limit" in res.output
    assert (out / "report.md").exists()


def test_too_few_tokens_for_the_answers_is_refused_before_anything_is_written(runner, tmp_path):
    out = tmp_path / "run"
    config = dataset_config(tmp_path)
    res = runner.invoke(app, ["run", str(config), *TINY, "--set", "rollout.max_new_tokens=8",
                              "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "rollout.max_new_tokens=8 is below the" in res.stderr
    assert "Set rollout.max_new_tokens=" in res.stderr and not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "env.name=tests.toy_envs:ResetFails"],
         "train task 'train-0-0': reset raised RuntimeError: simulated reset bug"),
        (["--set", "env.name=dataset", "--set", "env.args={path: no/such.jsonl}"],
         "data file no/such.jsonl does not exist"),
    ],
)  # fmt: skip
def test_preflight_stops_before_the_model_loads(runner, tmp_path, args, needle):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "load model" not in res.output
    assert not out.exists()


def test_a_reward_outside_the_range_is_an_env_error_naming_it(runner, tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", *TINY, "--set", "env.name=tests.toy_envs:LoudPickSeven",
                              "--set", "env.error_budget=1000", "--out", str(out)])  # fmt: skip
    # each eval task the tiny model misses is an env error, so the eval fails
    assert res.exit_code == 2, res.output
    assert "reward=-100.0, outside its reward_range [-1.0, 1.0]" in res.stderr
    records = [json.loads(x) for x in (out / "samples" / "baseline.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    missed = [r for r in records if r["outcome"] != "hit"]
    assert missed and all(r["outcome"] == "env_error" for r in missed)
    assert all(r["reward"] == 0.0 and "reward=-100.0" in r["error"] for r in missed)


def test_an_eval_of_only_env_errors_fails_loudly(runner, tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", *TINY, "--set", "env.name=tests.toy_envs:StepFails",
                              "--out", str(out)])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "the baseline eval measured nothing: all 2 episodes ended in env_error" in res.stderr
    assert "simulated step bug" in res.stderr


def test_an_agent_failing_on_a_cut_call_is_truncated_not_an_env_error(runner, tmp_path):
    out = tmp_path / "eval.json"
    res = runner.invoke(app, ["eval", "--set", "model.name=tiny-random", "--set",
                              "env.name=tests.toy_envs:CarelessAgent", "--set", "eval.tasks=2",
                              "--set", "eval.samples_per_task=1", "--set",
                              "rollout.max_new_tokens=3", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["episode_outcomes"] == ["truncated", "truncated"]
    assert result["rewards"] == [-1.0, -1.0]  # the env's lowest reward


def test_a_run_that_trained_on_nothing_says_so(runner, tmp_path):
    out = tmp_path / "run"
    limits = ["--set", "rollout.max_new_tokens=40", "--set", "rollout.max_episode_tokens=120"]
    res = runner.invoke(app, ["run", str(dataset_config(tmp_path)), *TINY, *limits,
                              "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "the run trained on nothing" in res.stderr
    assert "the run trained on nothing" in (out / "report.md").read_text()


def test_envs_show_and_check_take_a_run_config(runner):
    config = str(BOOKINGS / "run.yaml")
    shown = runner.invoke(app, ["envs", "show", "--config", config, "--split", "eval"])
    assert shown.exit_code == 0, shown.output
    assert "dataset · task eval-" in shown.stdout and "book_meeting" in shown.stdout
    checked = runner.invoke(app, ["envs", "check", "--config", config, "--tasks", "32"])
    assert checked.exit_code == 0, checked.output
    assert "looprl envs check dataset" in checked.stdout and "FAIL" not in checked.stdout
    bare = runner.invoke(app, ["envs", "show"])
    assert bare.exit_code == 2 and "give a run config with --config" in bare.stderr


def test_the_shipments_example_runs_from_any_folder(runner, tmp_path, monkeypatch):
    # its data paths are relative to its own folder; the SKU is matched exactly
    monkeypatch.chdir(tmp_path)
    config = str(BOOKINGS.parent / "shipments" / "run.yaml")
    shown = runner.invoke(app, ["envs", "show", "--config", config])
    assert shown.exit_code == 0, shown.output
    assert "create_shipment" in shown.stdout and "sku: exact" in shown.stdout
    checked = runner.invoke(app, ["envs", "check", "--config", config, "--tasks", "16"])
    assert checked.exit_code == 0, checked.output
    assert "FAIL" not in checked.stdout
