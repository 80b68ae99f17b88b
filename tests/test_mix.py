"""`env.mix`: several environments by weight as one, with per-member metrics and report
rows; bad mixtures are clear errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import config_from_dict
from looprl.envs import make_env
from looprl.envs.check import check_env
from looprl.errors import ConfigError, EnvError
from looprl.types import Message, ToolCall

MEMBERS = [
    {"name": "tictactoe-move", "weight": 3},
    {"name": "tests.toy_envs:PickSeven", "weight": 1, "label": "pick"},
]


def test_tasks_are_drawn_by_weight_and_labelled():
    env = make_env("mix", {"members": MEMBERS})
    held = env.tasks("eval", n=8, seed=0)
    assert Counter(t.id.split("/")[0] for t in held) == {"tictactoe-move": 6, "pick": 2}
    assert [t.id for t in held] == [t.id for t in env.tasks("eval", n=8, seed=0)]
    train = env.tasks("train", n=400, seed=1)
    share = sum(t.id.startswith("pick/") for t in train) / 400
    again = env.tasks("train", n=400, seed=1)
    assert 0.18 < share < 0.32 and [t.id for t in train] == [t.id for t in again]
    assert not {t.id for t in held} & {t.id for t in train}
    assert env.reward_range == (-1.0, 1.0) and "hit" in env.outcomes and "optimal" in env.outcomes


def test_episodes_are_played_by_their_member():
    env = make_env("mix", {"members": MEMBERS})
    task = next(t for t in env.tasks("eval", n=8, seed=0) if t.id.startswith("pick/"))
    obs = env.reset(task)
    assert obs.tools[0]["function"]["name"] == "pick"
    result = env.step(Message("assistant", tool_calls=[ToolCall("pick", {"n": 7})]))
    assert (result.outcome, result.reward, result.info["mix_env"]) == ("hit", 1.0, "pick")
    assert env.demonstrations(task)[0].tool_calls[0].arguments == {"n": 7}


def test_a_member_reward_outside_its_own_range_raises():
    env = make_env("mix", {"members": [MEMBERS[0], {"name": "tests.toy_envs:LoudPickSeven"}]})
    task = next(t for t in env.tasks("eval", n=4, seed=0) if "LoudPickSeven" in t.id)
    env.reset(task)
    with pytest.raises(EnvError, match="returned reward=-100.0, outside its reward_range"):
        env.step(Message("assistant", tool_calls=[ToolCall("pick", {"n": 2})]))


@pytest.mark.parametrize(
    ("members", "needle"),
    [
        ([MEMBERS[0]], "at least two"),
        ([MEMBERS[0], {"name": "tictactoe-move"}], "label 'tictactoe-move' is taken"),
        ([MEMBERS[0], {"name": "pick", "wieght": 2}], "unknown keys ['wieght']"),
        ([MEMBERS[0], {"name": "tests.toy_envs:PickSevenAgent"}], "agents cannot be mixed"),
        ([MEMBERS[0], {"name": "checkers"}], "env.mix[1] (checkers): unknown environment"),
        ([MEMBERS[0], {"name": "extraction", "weight": 0}], "weight=0 must be a number above 0"),
    ],
)
def test_bad_mixtures_are_clear(members, needle):
    with pytest.raises(EnvError) as err:
        make_env("mix", {"members": members})
    assert needle in str(err.value)


def test_env_mix_is_the_mix_env_and_refuses_a_second_name():
    cfg = config_from_dict({"env": {"mix": MEMBERS}})
    assert cfg.env.name == "mix" and cfg.env.args == {"members": MEMBERS}
    with pytest.raises(ConfigError, match="give env.mix alone"):
        config_from_dict({"env": {"mix": MEMBERS, "name": "extraction"}})


def test_the_kit_passes_a_mixture():
    report = check_env("mix", {"members": MEMBERS}, n=24)
    assert report.ok, [(c.name, c.detail) for c in report.checks if not c.ok]


def test_a_mixed_run_reports_each_member(tmp_path):
    config = {"env": {"mix": MEMBERS}, "model": {"name": "tiny-random"},
              "train": {"steps": 1},
              "rollout": {"tasks_per_step": 4, "group_size": 2, "max_new_tokens": 32},
              "eval": {"tasks": 8, "samples_per_task": 1, "greedy": False}}  # fmt: skip
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "mix.yaml"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert any(k.startswith("mix/") and k.endswith("/rewards_mean") for k in step)
    report = (out / "report.md").read_text()
    assert "## By environment" in report and "| pick | 2 |" in report
    assert "| tictactoe-move | 6 |" in report
    assert "  pick: " in res.stdout
