"""`env.name: reasoning-gym:<dataset>`: reasoning-gym's generators and scorers as an
environment (unit), its mistakes as clear errors, and a run through the real CLI on the
tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.envs import env_class, list_envs, make_env
from looprl.envs.check import check_env
from looprl.errors import EnvError
from looprl.types import Message, ToolCall

pytest.importorskip("reasoning_gym", reason="pip install 'looprl[reasoning-gym]'")

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
NAME = "reasoning-gym:chain_sum"


@pytest.fixture()
def runner():
    return CliRunner()


def call(answer: str) -> Message:
    return Message("assistant", tool_calls=[ToolCall("answer", {"answer": answer})])


def test_the_adapter_is_listed_and_bound_by_name():
    assert "reasoning-gym:<dataset>" in list_envs()
    cls = env_class(NAME)
    assert cls.name == NAME and cls.target == "chain_sum"


def test_tasks_are_seeded_and_the_splits_never_share_a_question():
    # 2 one-digit terms: 200 questions at most, so the 64 held-out ones are a third of them
    env = make_env(NAME, {**SMALL, "eval_size": 64, "train_size": 2000})
    held = env.tasks("eval")
    assert len(held) == 64 and [t.id for t in held] == [t.id for t in env.tasks("eval")]
    train = env.tasks("train", n=300, seed=3)
    assert [t.data for t in train] == [t.data for t in env.tasks("train", n=300, seed=3)]
    assert not {t.data["question"] for t in held} & {t.data["question"] for t in train}
    assert env.tasks("train", n=5, seed=4) != env.tasks("train", n=5, seed=3)


def test_its_own_scorer_is_the_reward():
    env = make_env(NAME, SMALL)
    task = env.tasks("eval", n=1)[0]
    expected = task.data["answer"]
    env.reset(task)
    result = env.step(call(expected))
    assert (result.reward, result.outcome, result.done) == (1.0, "correct", True)
    env.reset(task)
    assert env.step(call(f"{expected}0000")).outcome in ("wrong", "partial")
    env.reset(task)
    failure = env.step(Message("assistant", "no call", parse_failure="no_tool_call"))
    assert (failure.reward, failure.outcome) == (-1.0, "no_tool_call")


def test_text_answers_are_read_from_answer_tags():
    env = make_env(NAME, {**SMALL, "answer": "text", "failure_reward": 0})
    task = env.tasks("eval", n=1)[0]
    obs = env.reset(task)
    assert obs.tools == [] and "<answer>" in obs.messages[0].content
    reply = f"Let me add.\n<answer>{task.data['answer']}</answer>"
    assert env.step(Message("assistant", reply)).outcome == "correct"
    env.reset(task)
    result = env.step(Message("assistant", task.data["answer"]))
    assert (result.outcome, result.reward) == ("no_answer", 0.0)
    assert env.reward_range == (0.0, 1.0)


@pytest.mark.parametrize("answer", ["tool", "text"])
def test_the_env_kit_passes(answer):
    report = check_env(NAME, {**SMALL, "answer": answer})
    assert report.ok, [(c.name, c.detail) for c in report.checks if not c.ok]


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("reasoning-gym:chain_summ", {}, "did you mean chain_sum"),
        ("reasoning-gym:", {}, "name what to run after the colon"),
        (NAME, {"min_term": 2}, "unknown env.args ['min_term']"),
        (NAME, {"min_terms": 5, "max_terms": 2}, "its config refuses"),
        (NAME, {"answer": "json"}, "answer='json' is invalid"),
    ],
)
def test_mistakes_are_clear_errors(name, args, needle):
    with pytest.raises(EnvError, match=None) as err:
        make_env(name, args)
    assert needle in str(err.value)


def test_an_unknown_name_gets_a_guess_then_every_dataset_by_family(runner):
    import reasoning_gym

    res = runner.invoke(app, ["envs", "check", "reasoning-gym:chain_summ"])
    assert res.exit_code == 2
    head, intro, *rows = res.stderr.strip().splitlines()
    assert head.endswith(
        "has no dataset 'chain_summ'; did you mean chain_sum or decimal_chain_sum?"
    )
    datasets = reasoning_gym.factory.DATASETS
    assert intro == f"Its {len(datasets)} datasets, by family (env.name: reasoning-gym:<dataset>):"
    assert all(len(row) <= 88 for row in rows)  # wrapped, never 100 names on one line
    families: dict[str, str] = {}  # a family's row, then its rows indented further
    family = ""
    for row in rows:
        if row.startswith("    "):
            families[family] += " " + row.strip()
        else:
            family, families[family] = row.strip().split(": ", 1)
    named = [n for names in families.values() for n in names.split(", ")]
    assert sorted(named) == sorted(datasets)  # each one, once
    assert "chain_sum" in families["arithmetic"].split(", ")


def test_a_dataset_trains_through_the_cli(runner, tmp_path):
    out = tmp_path / "run"
    sets = [f"env.args.{k}={v}" for k, v in SMALL.items()] + [
        f"env.name={NAME}", "model.name=tiny-random", "train.steps=1",
        "rollout.tasks_per_step=2", "rollout.group_size=2", "eval.tasks=2",
        "eval.samples_per_task=1", "rollout.max_new_tokens=48",
    ]  # fmt: skip
    res = runner.invoke(app, ["run", "--out", str(out), *sum((["--set", s] for s in sets), [])])
    assert res.exit_code == 0, res.output
    baseline = json.loads((out / "eval" / "baseline.json").read_text())
    assert baseline["env"] == NAME and baseline["solved_outcomes"] == ["correct"]
    assert (out / "metrics.jsonl").exists() and (out / "report.md").exists()
    show = runner.invoke(app, ["envs", "show", NAME, "--arg", "min_terms=2", "--arg",
                               "max_terms=2"])  # fmt: skip
    assert show.exit_code == 0 and "State the final answer" in show.output, show.output


def test_partial_credit_can_be_turned_off():
    # the base scorer gives a reply containing the answer len(answer)/len(reply)
    loose, strict = make_env(NAME, SMALL), make_env(NAME, {**SMALL, "partial_credit": False})
    task = next(t for t in loose.tasks("eval") if len(t.data["answer"]) == 1)
    for env, reward in ((loose, 0.5), (strict, 0.0)):
        env.reset(task)
        result = env.step(call(f"1{task.data['answer']}"))
        assert result.reward == reward and result.outcome in env.outcomes
    assert "partial" not in strict.outcomes
