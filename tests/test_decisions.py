"""algo.loss_on=free: the policy update sees only the tokens a forced call's grammar left
free (the decision), found again from each turn's recorded grammar."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest

from looprl.config import config_from_dict
from looprl.envs import make_env
from looprl.loop.decisions import decision_metrics, decision_view, grammar_cache
from looprl.loop.dist import Dist
from looprl.loop.groups import play_step
from looprl.loop.levers import Levers
from looprl.loop.play import player
from looprl.loop.policy import load_policy
from looprl.loop.train import run_training


def _played(env: dict, tasks: int = 2, group: int = 4):
    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random"},
            "env": env,
            "rollout": {"tasks_per_step": tasks, "group_size": group, "max_new_tokens": 32},
            "algo": {"name": "gspo_turn", "loss_on": "free"},
        }
    )
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)
    decide = partial(decision_view, grammars=grammar_cache(policy), tokenizer=policy.tokenizer)
    play = player(cfg, policy, probe)
    played, _ = play_step(
        cfg, probe, play, Dist(), step=1, history={}, levers=Levers(decide=decide)
    )
    return policy, probe, played


@pytest.fixture(scope="module")
def game():
    return _played({"name": "tictactoe-game", "args": {"opponent": "random"}})


def test_decision_view_keeps_each_forced_calls_square(game):
    policy, probe, played = game
    grammars = grammar_cache(policy)
    assert played.episodes
    for episode in played.episodes:
        before = list(episode.loss_mask)
        view = decision_view(episode, grammars, policy.tokenizer)
        assert episode.loss_mask == before  # the recorded episode is left as it was
        assert view.token_ids is episode.token_ids and view.logprobs is episode.logprobs
        assert len(view.loss_mask) == len(before)
        # a decision token is a generated one
        assert all(m <= b for m, b in zip(view.loss_mask, before))
        for turn in episode.turns:
            assert turn.constraint is not None  # the game forces its call every turn
            start = len(turn.prompt_ids)
            picked = [t for t, m in zip(turn.completion_ids, view.loss_mask[start:]) if m]
            call = policy.renderer.parse(turn.text, probe.reset(episode.task).tools)
            if call.failure is None:  # the forced call always parses; its digit is free
                square = call.calls[0].arguments["square"]
                assert policy.tokenizer.decode(picked) == str(square)
    # the masked tokens are few: one per move, against ≈ 20 for the whole call
    moves = sum(len(e.turns) for e in played.episodes)
    decisions = sum(
        sum(decision_view(e, grammars, policy.tokenizer).loss_mask) for e in played.episodes
    )
    generated = sum(sum(e.loss_mask) for e in played.episodes)
    assert decisions == moves < generated / 10


def test_a_free_choice_call_keeps_every_token():
    # tool_choice auto: no grammar while sampling, so nothing is forced
    policy, _, played = _played(
        {"name": "tictactoe-move", "args": {"tool_choice": "auto"}}, tasks=1, group=3
    )
    grammars = grammar_cache(policy)
    for episode in played.episodes:
        assert all(turn.constraint is None for turn in episode.turns)
        assert decision_view(episode, grammars, policy.tokenizer).loss_mask == episode.loss_mask


def test_the_steps_views_and_decision_metrics(game):
    policy, _, played = game
    grammars = grammar_cache(policy)
    views = played.learners(views=True)
    assert [a for _, a in views] == [a for _, a in played.learners()]
    assert all(v.response_len == len(v.turns) for v, _ in views)
    for group in played.groups:  # each member's view, built once when the step was played
        for e, v in zip(group.episodes, group.views, strict=True):
            assert v.loss_mask == decision_view(e, grammars, policy.tokenizer).loss_mask
    every_view = [v for g in played.groups for v in g.views]
    metrics = decision_metrics(played.episodes, every_view)
    trainable = [e for e in played.episodes if e.trainable]
    moves = sum(len(e.turns) for e in trainable)
    assert metrics["rollout/decision_tokens"] == pytest.approx(moves / len(trainable))
    # the mean surprisal of the sampled squares, by hand from the recorded logprobs
    surprisal = []
    for e in trainable:
        for turn in e.turns:
            view = decision_view(e, grammars, policy.tokenizer)
            start = len(turn.prompt_ids)
            surprisal += [
                -lp for lp, m in zip(turn.completion_logprobs, view.loss_mask[start:]) if m
            ]
    assert metrics["rollout/decision_entropy"] == pytest.approx(sum(surprisal) / len(surprisal))
    # the untrained model's logits are near uniform over its whole vocabulary (the
    # recorded logprobs are the model's own, not renormalised over the grammar's digits)
    vocab = len(policy.tokenizer)
    assert abs(metrics["rollout/decision_entropy"] - math.log(vocab)) < 1.0


def test_a_run_with_loss_on_free_trains_on_the_decisions(tmp_path):
    cfg = {
        "model": {"name": "tiny-random"},
        "env": {"name": "tictactoe-move"},
        "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
        "algo": {"loss_on": "free", "eps_low": 0.2, "eps_high": 0.28},
        "train": {"steps": 2, "checkpoint_every": 0, "lr": 1e-2},
        "eval": {"tasks": 2, "samples_per_task": 1, "greedy": False},
        "logging": {"trackers": []},
    }
    run = tmp_path / "run"
    run_training(config_from_dict(cfg), run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/decision_tokens"] == pytest.approx(1.0)  # one digit a call
        assert row["rollout/decision_entropy"] > 0
        assert row["response_len"] > 10  # the record keeps the whole call
    # a step whose groups all drew equal rewards has nothing to learn (no loss); every
    # step with a group of unequal rewards trained, and at least one had such a group
    trained = [row for row in rows if row["train/zero_std_groups"] < row["train/kept_groups"]]
    assert trained
    assert all(math.isfinite(row["train/loss"]) for row in trained)
    assert (run / "report.md").exists()


def test_decision_span_by_hand():
    from looprl.loop.decisions import decision_span

    assert decision_span([0, 0, 1, 0, 0]) == [0, 0, 1, 0, 0]  # a square's digit
    # free text, forced scaffold, a free digit: one run, so one turn for gspo_turn
    assert decision_span([1, 1, 0, 0, 1, 0]) == [1, 1, 1, 1, 1, 0]
    assert decision_span([0, 0, 0]) == [0, 0, 0]
    assert decision_span([]) == []


def test_play_step_with_an_entropy_bonus():
    """entropy_coef on the tiny model: every kept advantage is the rewards' own plus β ×
    the episode's decision surprisal minus its group's mean."""
    from looprl.algo import episode_advantages
    from looprl.loop.decisions import decision_surprisal

    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random"},
            "env": {"name": "tictactoe-move"},
            "rollout": {"tasks_per_step": 3, "group_size": 4, "max_new_tokens": 32},
            "algo": {"experimental": {"entropy_coef": 0.5}},
        }
    )
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)
    grammars = grammar_cache(policy)
    decide = partial(decision_view, grammars=grammars, tokenizer=policy.tokenizer)
    played, _ = play_step(
        cfg,
        probe,
        player(cfg, policy, probe),
        Dist(),
        step=1,
        history={},
        levers=Levers(decide=decide),
    )
    episodes = played.episodes
    plain, _ = episode_advantages([e.reward for e in episodes], [e.trainable for e in episodes], 4)
    for g, group in enumerate(played.groups):
        b = [decision_surprisal(decide(e)) for e in group.episodes]
        # the digit's surprisal: one token of a near-uniform vocabulary
        assert all(abs(x - math.log(len(policy.tokenizer))) < 2.0 for x in b)
        mean = sum(b) / 4
        for e, x, a, a0 in zip(group.episodes, b, group.advantages, plain[4 * g :]):
            if e.trainable:
                assert a == pytest.approx(a0 + 0.5 * (x - mean), abs=1e-6)


def test_a_run_with_an_entropy_bonus_logs_the_decisions(tmp_path):
    cfg = {
        "model": {"name": "tiny-random"},
        "env": {"name": "tictactoe-move"},
        "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
        "algo": {"experimental": {"entropy_coef": 0.1}},
        "train": {"steps": 1, "checkpoint_every": 0},
        "eval": {"tasks": 2, "samples_per_task": 1, "greedy": False},
        "logging": {"trackers": []},
    }
    run_training(config_from_dict(cfg), tmp_path / "run")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rollout/decision_tokens"] == pytest.approx(1.0)
    assert row["rollout/decision_entropy"] > 0 and math.isfinite(row["train/loss"])
