"""`verifiers:<module[:name]>` with `api: classic`: a verifiers 0.1.x environment
(`vf.SingleTurnEnv`, `vf.ToolEnv`, `vf.Rubric`) played through the worker in its own
environment (`.venv-verifiers-classic`). The environments are built from local data
(tests/verifiers_tasks/classic_*.py): arithmetic (single turn, an eval dataset of its own)
and a table lookup tool (multi-turn, a seeded held-out split)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import make_env
from looprl.envs.adapters import verifiers_env as ve
from looprl.errors import EnvError
from looprl.types import Message, ToolCall

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (ROOT / ".venv-verifiers-classic" / "bin" / "python").is_file(),
    reason="verifiers' classic environment is absent: `make setup-verifiers` makes "
    ".venv-verifiers-classic",
)
ARITH = "verifiers:tests.verifiers_tasks.classic_arith"
LOOKUP = "verifiers:tests.verifiers_tasks.classic_lookup"
CLASSIC = {"api": "classic"}
TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1"]  # fmt: skip


@pytest.fixture(autouse=True)
def from_the_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the worker imports tests.verifiers_tasks from here


def reply(text: str = "", *calls: ToolCall, failure: str | None = None) -> Message:
    return Message("assistant", text, tool_calls=list(calls), parse_failure=failure)


def test_a_single_turn_env_scores_each_reward_function_with_its_weight():
    env = make_env(ARITH, CLASSIC)
    assert env.weights == {"exact": 1.0, "format": 0.2} and env.max_turns == 1
    assert env.reward_range == (0.0, 1.2) and env.outcomes == ("correct", "partial", "wrong")
    task = env.tasks("eval")[0]
    obs = env.reset(task)
    assert [(m.role, m.content) for m in obs.messages] == [
        ("system", "Answer with the number only."), ("user", task.data["prompt"])]  # fmt: skip
    assert obs.tools == []
    right = env.step(reply(task.data["answer"]))
    assert right.done and right.outcome == "correct" and right.reward == pytest.approx(1.2)
    assert right.info["scores"] == {"exact": 1.0, "format": 1.0}
    assert right.info["weights"] == {"exact": 1.0, "format": 0.2}
    assert right.info["metrics"] == {"num_turns": 1.0}  # the MultiTurnEnv's monitor, weight 0
    env.reset(task)
    near = env.step(reply(f"It is {task.data['answer']}."))
    assert (near.outcome, near.reward, near.info["scores"]["format"]) == ("partial", 1.0, 0.0)
    env.reset(task)
    assert env.step(reply("no idea")).outcome == "wrong"
    assert env.demonstrations(task) == [Message("assistant", task.data["answer"])]


def test_the_envs_eval_dataset_is_held_out_else_a_seeded_share_and_never_overlaps():
    env = make_env(ARITH, CLASSIC)
    train, held = env.tasks("train"), env.tasks("eval")
    # 6 eval rows; of 30 train rows the one the eval set repeats is dropped
    assert len(held) == 6 and len(train) == 29
    assert all(t.data["name"].startswith("eval_dataset-") for t in held)
    assert not {t.data["prompt"] for t in train} & {t.data["prompt"] for t in held}
    tools = make_env(LOOKUP, CLASSIC)
    train, held = tools.tasks("train"), tools.tasks("eval")
    assert (len(train), len(held)) == (7, 1)  # 10% of 8, seeded (split_seed)
    assert not {t.data["prompt"] for t in train} & {t.data["prompt"] for t in held}


def test_a_tool_runs_in_the_worker_as_the_tool_env_defines_it():
    env = make_env(LOOKUP, CLASSIC)
    assert env.max_turns == 10 and env.reward_range == (0.0, 1.5)
    assert "max_turns" in env.outcomes and "bad_json" in env.outcomes
    task = next(t for t in env.tasks("train") if "apple" in t.data["prompt"])
    obs = env.reset(task)
    assert obs.tool_choice == "auto" and obs.tools[0]["function"]["name"] == "lookup"
    assert obs.tools[0]["function"]["parameters"]["required"] == ["key"]
    looked = env.step(reply("", ToolCall("lookup", {"key": "apple"})))
    assert not looked.done and looked.messages[0].role == "tool"
    assert looked.messages[0].content == "red" and looked.messages[0].tool_call_id
    missing = env.step(reply("", ToolCall("lookup", {"key": "nope"})))  # outside the enum
    assert "no key 'nope'" in missing.messages[0].content  # the tool's error, as ToolEnv puts it
    done = env.step(reply("It is red.", failure="no_tool_call"))
    assert done.done and done.info["scores"] == {"answer": 1.0, "used_tool": 1.0}
    assert done.reward == pytest.approx(1.5) and done.outcome == "correct"
    assert done.info["metrics"]["lookup_calls"] == 2.0  # the ToolEnv's monitor rubric


def test_a_reward_function_that_raises_is_an_env_error_not_a_zero():
    env = make_env(ARITH, {**CLASSIC, "config": {"explode": True}})
    assert env.weights == {"exact": 1.0, "format": 0.2, "explodes": 0.5}
    env.reset(env.tasks("eval")[0])
    with pytest.raises(EnvError, match="this reward function always raises"):
        env.step(reply("7"))


def test_what_cannot_run_is_one_clear_error(monkeypatch, tmp_path):
    with pytest.raises(EnvError, match="verifiers: ChattyEnv.env_response answers a whole"):
        make_env("verifiers:tests.verifiers_tasks.classic_chatty", CLASSIC)
    with pytest.raises(EnvError, match="cannot import module 'tests.verifiers_tasks.nope'"):
        make_env("verifiers:tests.verifiers_tasks.nope", CLASSIC)
    monkeypatch.setattr(ve, "REPO", tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EnvError, match=r"make setup-verifiers.*\.venv-verifiers-classic"):
        ve.find_python(None, "classic")


def test_a_classic_env_trains_through_the_cli_and_reports_each_reward_function(tmp_path):
    # forced calls: the tiny random model ends a reply only where a grammar ends it
    config = {"env": {"name": LOOKUP, "args": {**CLASSIC, "tool_choice": "required",
                                               "max_turns": 2}},
              "rollout": {"max_new_tokens": 48}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "run.yaml"), *TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"scores/answer", "scores/used_tool"} <= set(step), step
    baseline = json.loads((out / "eval" / "baseline.json").read_text())
    assert baseline["env"] == LOOKUP and baseline["solved_outcomes"] == ["correct"]
    assert (out / "report.md").exists()
