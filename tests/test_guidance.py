"""algo.expert_samples: the env's demonstration as a member of each RL group."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from looprl.algo.advantages import anchored_advantages, episode_advantages, group_advantages
from looprl.config import config_from_dict
from looprl.envs import make_env
from looprl.envs.builtin.tictactoe import TicTacToeGame
from looprl.envs.builtin.tictactoe_board import expert_move
from looprl.loop.dist import Dist
from looprl.loop.groups import play_step
from looprl.loop.guidance import (
    expert_advantage,
    expert_episode,
    safe_expert_episode,
)
from looprl.loop.levers import Levers
from looprl.loop.play import player
from looprl.loop.policy import load_policy
from looprl.loop.train import run_training
from looprl.types import ENV_ERROR, Episode, Message, Task


def test_expert_episode_records_a_whole_game(renderer):
    env = TicTacToeGame(opponent="random", move_rewards=True)
    task = env.tasks("train", n=2, seed=3)[1]  # the agent plays O here
    episode = expert_episode(env, task, renderer, temperature=0.7)
    assert episode.expert and episode.temperature == 0.7 and episode.trainable
    assert len(episode.turns) >= 3
    generated = 0
    for turn in episode.turns:
        start, end = len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.completion_ids)
        # each call's prompt is the record so far; its tokens are the only masked ones there
        assert episode.token_ids[:start] == turn.prompt_ids
        assert episode.token_ids[start:end] == turn.completion_ids
        assert episode.loss_mask[start:end] == [1] * len(turn.completion_ids)
        assert turn.constraint is not None  # the game forces its call: the grammar is kept
        assert turn.completion_logprobs == [0.0] * len(turn.completion_ids)
        generated += len(turn.completion_ids)
    assert episode.response_len == generated
    assert set(episode.logprobs) == {0.0}
    # the calls are the expert's moves, each graded best by minimax
    replay = TicTacToeGame(opponent="random")
    tools = replay.reset(task).tools
    for turn in episode.turns:
        call = renderer.parse(turn.text, tools)
        square = call.calls[0].arguments["square"]
        assert square == expert_move(replay._state.board, replay._state.agent)
        result = replay.step(Message("assistant", tool_calls=call.calls))
    assert episode.outcome == result.outcome in ("win", "draw")
    assert episode.reward == result.reward
    assert episode.turn_rewards == [1.0] * len(episode.turns)


class _Raising:
    """An env whose demonstration makes step() raise."""

    max_turns = 1

    def reset(self, task):
        return TicTacToeGame().reset(task)

    def demonstrations(self, task):
        return TicTacToeGame().demonstrations(task)

    def step(self, message):
        raise RuntimeError("simulated environment bug")


def test_an_env_bug_ends_the_expert_episode_only(renderer):
    task = TicTacToeGame().tasks("train", n=1)[0]
    episode = safe_expert_episode(_Raising, task, renderer, 1.0)
    assert episode.outcome == ENV_ERROR and episode.expert and not episode.trainable
    assert "simulated environment bug" in episode.error


def _episode(name: str, expert: bool = False) -> Episode:
    return Episode(task=Task(id=name, data={}), messages=[], token_ids=[1], loss_mask=[1],
                   logprobs=[0.0], outcome=name, expert=expert)  # fmt: skip


def test_play_groups_puts_k_experts_at_the_end_of_each_group():
    from looprl.config import config_from_dict
    from looprl.engine import SamplingParams
    from looprl.loop.groups import play_groups

    cfg = config_from_dict({"rollout": {"group_size": 5}, "algo": {"expert_samples": 2}})
    tasks = [Task(id="a", data={}), Task(id="b", data={})]

    def play(tasks, *, params, first_index=0, on_progress=None):  # stream i: its name
        return [_episode(f"{t.id}{first_index + i}") for i, t in enumerate(tasks)]

    groups = play_groups(cfg, play, tasks, SamplingParams(), 2,
                         lambda task: _episode(f"expert-{task.id}", True))  # fmt: skip
    assert [g.task for g in groups] == tasks
    assert [[e.outcome for e in g.episodes] for g in groups] == [
        ["a6", "a7", "a8", "expert-a", "expert-a"],
        ["b9", "b10", "b11", "expert-b", "expert-b"],
    ]  # fmt: skip  (the third task of the step: its samples take streams 6 on)
    assert [e.expert for e in groups[0].episodes] == [False] * 3 + [True] * 2
    assert groups[0].episodes[3] is not groups[0].episodes[4]  # copies, not one episode twice


def test_expert_advantage_by_hand():
    plain, other, expert = _episode("x"), _episode("y"), _episode("e", True)
    assert expert_advantage([(plain, -0.5), (expert, 1.5)]) == 1.5
    assert expert_advantage([(expert, (1.0, 2.0)), (replace(expert), 0.5)]) == 1.0
    assert expert_advantage([(plain, 1.0), (other, -1.0)]) == 0.0


def test_anchored_advantages_by_hand():
    # seven samples tie below the expert: they take 0, the expert its lead over the std of
    # all eight, 0.5 / (0.5 * sqrt(7) / 8)
    samples, lead = anchored_advantages([0.5] * 7, [1.0])
    assert samples == [0.0] * 7
    assert lead == [pytest.approx(8 / math.sqrt(7), rel=1e-5)]
    # samples that differ keep exactly their own group's advantages; the expert's lead is
    # over their mean, 1 - 1/2, divided by the std of [0, 1, 1] (sqrt(2) / 3)
    samples, lead = anchored_advantages([0.0, 1.0], [1.0])
    assert samples == pytest.approx(group_advantages(torch.tensor([0.0, 1.0])).tolist())
    assert lead == [pytest.approx(0.5 / (math.sqrt(2) / 3), rel=1e-5)]
    # an expert behind the samples pulls nothing, and is never negative
    samples, lead = anchored_advantages([1.0, 0.0], [0.0])
    assert samples == pytest.approx([1.0, -1.0], rel=1e-5) and lead == [0.0]
    assert anchored_advantages([1.0] * 3, [1.0]) == ([0.0] * 3, [0.0])
    assert anchored_advantages([], [1.0]) == ([], [0.0])
    # Dr.GRPO: no division
    assert anchored_advantages([0.0, 0.0], [1.0], scale=False) == ([0.0, 0.0], [1.0])


def test_episode_advantages_with_an_expert_baseline():
    anchors = [False, False, False, True] * 3
    rewards = [0.5, 0.5, 0.5, 1.0] + [1.0, 1.0, 1.0, 0.0] + [0.0, 1.0, 1.0, 1.0]
    advantages, zero_std = episode_advantages(
        rewards, [True] * 12, 4, dynamic_sampling=True, anchors=anchors
    )
    assert zero_std == 0
    # group 1: only the expert moves; group 2: the expert is behind, nothing moves: dropped
    assert advantages[:3] == [0.0] * 3 and advantages[3] > 0
    assert advantages[4:8] == [None] * 4
    # group 3: the samples' own advantages, the expert's lead over their mean 2/3
    own = group_advantages(torch.tensor([0.0, 1.0, 1.0])).tolist()
    assert advantages[8:11] == pytest.approx(own)
    assert advantages[11] == pytest.approx((1 - 2 / 3) / float(torch.tensor(rewards[8:]).std(
        unbiased=False)), rel=1e-5)  # fmt: skip
    # an untrainable sample leaves the group; without anchors the expert is one member
    advantages, _ = episode_advantages(
        [0.0, 0.0, 1.0, 1.0], [True, False, True, True], 4, anchors=[False] * 3 + [True]
    )
    assert advantages[1] is None
    assert advantages[0] == pytest.approx(-1.0, rel=1e-5)
    plain, _ = episode_advantages([0.5, 0.5, 1.0], [True] * 3, 3)
    assert plain[0] < 0
    # per-turn terms: the samples' turns among themselves, the expert's turns by their lead
    turns = [[1.0, 0.0], [0.0], [1.0, 1.0]]
    advantages, _ = episode_advantages(
        [0.0, 0.0, 1.0], [True] * 3, 3, turn_rewards=turns, turn_weight=0.5, turn_gamma=0.0,
        anchors=[False, False, True],
    )  # fmt: skip
    samples_turns, lead_turns = anchored_advantages([1.0, 0.0, 0.0], [1.0, 1.0])
    assert advantages[0] == pytest.approx((0.5 * samples_turns[0], 0.5 * samples_turns[1]))
    assert advantages[1] == pytest.approx((0.5 * samples_turns[2],))
    lead = anchored_advantages([0.0, 0.0], [1.0])[1][0]
    assert advantages[2] == pytest.approx((lead + 0.5 * lead_turns[0], lead + 0.5 * lead_turns[1]))
    with pytest.raises(ValueError, match="anchor flags"):
        episode_advantages([0.0, 1.0], [True] * 2, 2, anchors=[True])


@pytest.fixture(scope="module")
def guided():
    return _play_guided({})


def _play_guided(algo: dict):
    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random"},
            "env": {"name": "tictactoe-move"},
            "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
            "algo": {"expert_samples": 1, "tis_cap": 2.0, **algo},
        }
    )
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)

    def expert(task):
        return safe_expert_episode(lambda: make_env(cfg.env.name), task, policy.renderer, 1.0)

    play = player(cfg, policy, probe)
    played, _ = play_step(
        cfg, probe, play, Dist(), step=1, history={}, levers=Levers(expert=expert)
    )
    return cfg, policy, played


def test_each_group_ends_with_the_expert(guided):
    cfg, _, played = guided
    group = cfg.rollout.group_size
    assert len(played.episodes) == cfg.rollout.tasks_per_step * group
    for members, advantages in ((g.episodes, g.advantages) for g in played.groups):
        assert [e.expert for e in members] == [False] * (group - 1) + [True]
        assert len({e.task.id for e in members}) == 1
        # the expert's move is a best one (+0.8 or +1 on tictactoe-move): the group's best
        assert members[-1].reward >= 0.8
        assert members[-1].reward == max(e.reward for e in members)
        if advantages[-1] is not None and len({e.reward for e in members}) > 1:
            assert advantages[-1] == max(advantages) > 0


def test_the_samples_baseline_leaves_the_samples_their_own_advantages():
    cfg, _, played = _play_guided({"experimental": {"expert_baseline": "samples"}})
    group = cfg.rollout.group_size
    for members, advantages in ((g.episodes, g.advantages) for g in played.groups):
        assert [e.expert for e in members] == [False] * (group - 1) + [True]
        rewards = [e.reward for e in members]
        own = group_advantages(torch.tensor(rewards[:-1])).tolist()
        assert advantages[:-1] == pytest.approx(own, abs=1e-5)
        lead = max(0.0, rewards[-1] - sum(rewards[:-1]) / (group - 1))
        assert advantages[-1] >= 0 and (advantages[-1] > 0) == (lead > 0)


def test_the_update_takes_the_policy_as_the_experts_behaviour(guided):
    """The expert episode has logprobs 0: were they taken as its behaviour policy, the
    engine-vs-trainer gap would be ≈ log(vocab) and its TIS weights exp(log π) ≈ 0."""
    from looprl.loop.optim import make_optimizer
    from looprl.loop.update import UpdateState, update_policy

    cfg, policy, played = guided
    assert any(e.expert for e, _ in played.learners())
    optimizer = make_optimizer(policy.trainable_parameters(), "adamw", 1e-3, 0.0)
    stats = update_policy(
        policy, optimizer, played.groups, cfg.algo, cfg.train, group_size=4, max_tokens=32,
        seed=0, state=UpdateState(micro_batch_tokens=cfg.train.micro_batch_tokens),
    )  # fmt: skip
    assert stats["logprob_gap"] < 1e-3
    assert stats["updated"] >= 1 and math.isfinite(stats["loss"])


def _password_run(
    tmp_path, expert_samples: int, baseline: str = "group", steps: int = 12
) -> tuple[dict, list[dict]]:
    cfg = {
        "model": {"name": "tiny-random", "lora": {"enabled": False}, "tool_format": "llama3"},
        "env": {"name": "toy_envs:SayPassword"},
        "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 24},
        "algo": {
            "name": "gspo",
            "num_minibatches": 1,
            "expert_samples": expert_samples,
            "experimental": {"expert_baseline": baseline},
        },  # fmt: skip
        "train": {"steps": steps, "lr": 3e-3, "checkpoint_every": 0},
        "eval": {"tasks": 4, "temperature": 0.0, "samples_per_task": 1},
        "logging": {"trackers": [], "sample_every": 1, "samples_per_log": 8},
        "seed": 1,
    }
    run = tmp_path / f"run{expert_samples}-{baseline}"
    result = run_training(config_from_dict(cfg), run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_expert_guidance_teaches_what_sampling_never_finds(tmp_path):
    """SayPassword's answer is never sampled by the tiny model: without guidance no group
    has a hit and the greedy policy never says it; with one expert a group it does."""
    result, rows = _password_run(tmp_path, 0)
    assert max(r["rollout/rewards_mean"] for r in rows) < 1.0
    assert result["final"]["outcomes"].get("hit", 0.0) == 0.0
    assert "train/expert_advantage" not in rows[0]

    result, rows = _password_run(tmp_path, 1)
    assert result["baseline"]["outcomes"].get("hit", 0.0) == 0.0
    assert result["final"]["outcomes"] == {"hit": 1.0}
    assert all(r["train/expert_advantage"] > 0 for r in rows)
    assert all(r["rollout/logprob_gap"] < 1e-3 for r in rows)
    # rollout/* describe the policy's own samples: the expert's hits are not among them
    samples = [json.loads(x) for x in (tmp_path / "run1-group" / "samples" / "train.jsonl").open()]
    for row in rows:
        mine = [s for s in samples if s["step"] == row["step"] and not s.get("expert")]
        assert len(mine) == 6
        assert row["rollout/rewards_mean"] == pytest.approx(
            sum(s["reward"] for s in mine) / len(mine)
        )
    assert sum(bool(s.get("expert")) for s in samples) == 2 * len(rows)
    assert (
        "2 tasks × (3 samples + 1 expert demonstration) per step"
        in (tmp_path / "run1-group" / "report.md").read_text()
    )


def test_the_samples_baseline_pulls_toward_the_expert(tmp_path):
    """With the expert's lead as the only push (the samples that all fail take 0), the
    samples learn from the expert's episode alone: the tiny model's calls, all malformed at
    first, become valid. It is slower than the group baseline here: after 24 steps the
    word itself is not yet learned (the group baseline's push off the samples' own wrong
    answers gets it in 12, above); measured on the demo's board in docs/learning.md."""
    result, rows = _password_run(tmp_path, 1, "samples", steps=24)
    assert result["baseline"]["outcomes"].get("hit", 0.0) == 0.0
    assert all(r["train/expert_advantage"] > 0 for r in rows)
    first = sum(r["rollout/rewards_mean"] for r in rows[:4]) / 4
    last = sum(r["rollout/rewards_mean"] for r in rows[-4:]) / 4
    assert first == -1.0 and last > -0.6
