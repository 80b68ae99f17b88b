"""`verifiers:<module[:Class]>`: a verifiers (v1) taskset played through the worker in
verifiers' own environment (`.venv-verifiers`, `make setup-verifiers`). The tasksets are
local (tests/verifiers_tasks/): arithmetic (single turn) and a table lookup tool (multi-turn,
with tool state)."""

from __future__ import annotations

import json
import os
import signal
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
    not (ROOT / ".venv-verifiers" / "bin" / "python").is_file(),
    reason="verifiers' own environment is absent: `make setup-verifiers` makes .venv-verifiers",
)
ARITH, LOOKUP = "verifiers:tests.verifiers_tasks.arith", "verifiers:tests.verifiers_tasks.lookup"
TINY = ["--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1"]  # fmt: skip


@pytest.fixture(autouse=True)
def from_the_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the worker imports tests.verifiers_tasks from here


def reply(text: str = "", *calls: ToolCall, failure: str | None = None) -> Message:
    return Message("assistant", text, tool_calls=list(calls), parse_failure=failure)


# ------------------------------------------------------------------ single turn


def test_a_single_turn_taskset_scores_each_reward_function_with_its_weight():
    env = make_env(ARITH)
    assert env.weights == {"exact": 1.0, "format": 0.2} and env.max_turns == 1
    assert env.reward_range == (0.0, 1.2) and env.outcomes == ("correct", "partial", "wrong")
    task = env.tasks("eval")[0]
    obs = env.reset(task)
    assert [m.role for m in obs.messages] == ["system", "user"] and obs.tools == []
    a, b = (int(x) for x in obs.messages[1].content.removeprefix("What is ")[:-1].split(" + "))
    right = env.step(reply(str(a + b)))
    assert right.done and right.outcome == "correct" and right.reward == pytest.approx(1.2)
    assert right.info["scores"] == {"exact": 1.0, "format": 1.0}
    assert right.info["weights"] == {"exact": 1.0, "format": 0.2}
    env.reset(task)
    near = env.step(reply(f"It is {a + b}."))
    assert (near.outcome, near.reward, near.info["scores"]["format"]) == ("partial", 1.0, 0.0)
    env.reset(task)
    assert env.step(reply("no idea")).outcome == "wrong"
    assert env.demonstrations(task) == [Message("assistant", str(a + b))]  # the data's answer


def test_the_splits_are_seeded_and_never_overlap():
    env = make_env(ARITH)
    train, held = env.tasks("train"), env.tasks("eval")
    assert len(held) == 4 and len(train) == 36  # 10% of 40 held out
    assert not {t.data["prompt"] for t in train} & {t.data["prompt"] for t in held}
    assert [t.id for t in env.tasks("train", 8, seed=3)] == [
        t.id for t in make_env(ARITH).tasks("train", 8, seed=3)
    ]
    other = make_env(ARITH, {"split_seed": 1}).tasks("eval")
    assert [t.id for t in other] != [t.id for t in held]
    assert len(make_env(ARITH, {"config": {"num_tasks": 10}}).tasks("train")) == 9


# ------------------------------------------------------------------ tools


def test_tool_calls_run_in_the_worker_and_the_tools_share_the_episode_state():
    env = make_env(LOOKUP)
    assert env.max_turns == 10 and env.reward_range == (-0.1, 1.5)
    assert "max_turns" in env.outcomes and "bad_json" in env.outcomes
    task = next(t for t in env.tasks("train") if "apple" in t.data["prompt"])
    obs = env.reset(task)
    assert obs.tool_choice == "auto" and obs.tools[0]["function"]["name"] == "lookup"
    assert obs.tools[0]["function"]["parameters"]["required"] == ["key"]
    looked = env.step(reply("", ToolCall("lookup", {"key": "apple"})))
    assert not looked.done and looked.messages[0].role == "tool"
    assert looked.messages[0].content == "red" and looked.messages[0].tool_call_id
    again = env.step(reply("", ToolCall("lookup", {"kee": "apple"})))
    assert "Field required" in again.messages[0].content  # a tool's error is its result
    env.step(reply("", ToolCall("lookup", {"key": "pear"})))  # the state counts 2 calls now
    done = env.step(reply("It is red.", failure="no_tool_call"))
    assert done.done and done.info["scores"] == {"answer": 1.0, "extra_calls": 1.0,
                                                 "used_tool": 1.0}  # fmt: skip
    assert done.reward == pytest.approx(1.4) and done.outcome == "partial"


def test_interleaved_episodes_keep_their_own_state_and_a_malformed_call_ends_one():
    first, second = make_env(LOOKUP), make_env(LOOKUP)
    tasks = first.tasks("train")
    first.reset(tasks[0])
    second.reset(tasks[1])
    first.step(reply("", ToolCall("lookup", {"key": "lime"})))
    second.step(reply("", ToolCall("lookup", {"key": "plum"})))
    assert first.step(reply("?", failure="no_tool_call")).info["scores"]["extra_calls"] == 0.0
    bad = second.step(reply("<tool_call>{", failure="bad_json"))
    assert (bad.done, bad.outcome, bad.reward) == (True, "bad_json", -0.1)


def test_the_last_turn_is_scored_as_it_stands():
    env = make_env(LOOKUP, {"max_turns": 2})
    env.reset(env.tasks("eval")[0])
    env.step(reply("", ToolCall("lookup", {"key": "kiwi"})))
    last = env.step(reply("", ToolCall("lookup", {"key": "kiwi"})))
    assert last.done and last.outcome == "max_turns" and last.info["scores"]["used_tool"] == 1.0


# ------------------------------------------------------------------ faults


def test_a_worker_that_dies_fails_its_episode_and_is_started_again():
    env = make_env(ARITH)
    task = env.tasks("eval")[0]
    env.reset(task)
    worker = env._worker()
    os.kill(worker.process.pid, signal.SIGKILL)
    with pytest.raises(EnvError, match=r"worker exited \(code -9\)") as err:
        env.step(reply("14"))
    assert "worker stderr" in str(err.value)
    fresh = make_env(ARITH)
    fresh.reset(task)
    assert fresh._worker() is not worker and fresh.step(reply("14")).done


def test_a_hung_worker_times_out(monkeypatch):
    env = make_env(ARITH, {"timeout_s": 0.5})
    worker = env._worker()
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(EnvError, match="did not answer reset within"):
            env.reset(env.tasks("eval")[0])
    finally:
        worker.close()
    assert not worker.alive()


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("verifiers:tests.verifiers_tasks.nope", "cannot import module 'tests.verifiers_"),
        ("verifiers:tests.verifiers_tasks.needs_sandbox", "task BoxTask needs a container"),
        ("verifiers:tests.verifiers_tasks.arith:Nope", "has no attribute 'Nope'"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_one_clear_error(name, needle):
    with pytest.raises(EnvError, match="verifiers: ") as err:
        make_env(name)
    assert needle in str(err.value) and "Traceback" not in str(err.value)


def test_no_verifiers_environment_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(ve, "REPO", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EnvError, match="make setup-verifiers"):
        ve.find_python(None)
    with pytest.raises(EnvError, match="does not exist"):
        ve.find_python(str(tmp_path / "python"))


# ------------------------------------------------------------------ through the CLI


def test_a_verifiers_taskset_trains_and_reports_each_reward_function(tmp_path):
    # forced calls: the tiny random model ends a reply only where a grammar ends it
    config = {"env": {"name": LOOKUP, "args": {"tool_choice": "required", "max_turns": 2}},
              "rollout": {"max_new_tokens": 48}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "run.yaml"), *TINY, "--out", str(out)])
    assert res.exit_code == 0, res.output
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"scores/answer", "scores/used_tool", "scores/extra_calls"} <= set(step), step
    baseline = json.loads((out / "eval" / "baseline.json").read_text())
    assert baseline["env"] == LOOKUP and baseline["solved_outcomes"] == ["correct"]
    assert (out / "report.md").exists()
