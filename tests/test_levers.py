"""Tests of the learning levers' pure parts: turn-level GSPO, refilling dynamic sampling
and the task curriculum (looprl/algo/turns.py, looprl/algo/selection.py)."""

from __future__ import annotations

import math

import pytest
import torch

from looprl.algo import (
    choose_tasks,
    gspo_loss,
    gspo_turn_loss,
    is_mastered,
    record_groups,
    refill_count,
    task_weights,
    turn_ids,
)

# ------------------------------------------------------------------ turn-level GSPO


def test_turn_ids_are_runs_of_the_mask():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0], [0] * 8])
    assert turn_ids(mask).tolist() == [
        [0, 1, 1, 0, 0, 2, 0, 3],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0] * 8,
    ]


def test_gspo_turn_hand_values():
    # episode 0: turns [0.2, 0.4] and [-0.3] (env tokens between, masked out), A = +1
    #   s_01 = exp(0.3) = 1.3499 > 1 + 0.1: clipped, obj 1.1; s_02 = exp(-0.3) = 0.7408 < 0.9:
    #   A > 0 so the unclipped branch s A wins the min (no clip); obj_0 = (1.1 + 0.7408) / 2
    # episode 1: one turn [0.05, 0.05], A = -2: s = exp(0.05) = 1.0513, inside; obj = -2.1025
    old = torch.zeros(2, 5, dtype=torch.float64)
    logp = torch.tensor(
        [[0.2, 0.4, 9.0, -0.3, 0.0], [0.05, 0.05, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
        requires_grad=True,
    )
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, stats = gspo_turn_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.1)

    s01, s02, s1 = math.exp(0.3), math.exp(-0.3), math.exp(0.05)
    obj0 = (1.1 * 1.0 + s02 * 1.0) / 2
    obj1 = s1 * -2.0
    assert loss.item() == pytest.approx(-(obj0 + obj1) / 2, rel=1e-12)
    assert stats["count"] == 3.0  # turns
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_max"] == pytest.approx(s01)
    assert stats["ratio_min"] == pytest.approx(s02)

    loss.backward()
    # turn 1 of episode 0 clipped: zero grad; turn 2: d/dlogp of -(1/2)(1/2) s02 = -s02/4
    # episode 1: -(1/2)(-2 s1) = s1, and d s1 / d logp_t = s1 / 2 (mean over its 2 tokens)
    expected = torch.tensor(
        [[0.0, 0.0, 0.0, -s02 / 4, 0.0], [s1 / 2, s1 / 2, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(logp.grad, expected)


def test_gspo_turn_equals_gspo_on_one_turn_episodes():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 7, generator=g, dtype=torch.float64)
    logp = (old + 0.2 * torch.randn(6, 7, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.1 * torch.randn(6, 7, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    # one contiguous run per row, after a prompt of varying length; row 5 empty
    mask = torch.zeros(6, 7, dtype=torch.float64)
    for row, (a, b) in enumerate([(0, 7), (2, 5), (1, 2), (3, 7), (0, 1), (0, 0)]):
        mask[row, a:b] = 1.0
    kw = {"eps_low": 0.05, "eps_high": 0.06, "ref_logp_BT": ref, "kl_coef": 0.1}
    l_seq, s_seq = gspo_loss(logp, old, adv, mask, **kw)
    (g_seq,) = torch.autograd.grad(l_seq, logp)
    l_turn, s_turn = gspo_turn_loss(logp, old, adv, mask, **kw)
    (g_turn,) = torch.autograd.grad(l_turn, logp)
    torch.testing.assert_close(l_turn, l_seq, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_turn, g_seq, rtol=0, atol=1e-12)
    assert s_turn == pytest.approx(s_seq)
    assert 0 < s_seq["clip_frac"] < 1  # both clipped and unclipped rows are covered


def test_gspo_turn_differs_from_gspo_when_turns_differ():
    # two turns with opposite log-ratios: the sequence ratio is 1, the turn ratios are not
    old = torch.zeros(1, 5, dtype=torch.float64)
    logp = torch.tensor([[0.5, 0.5, 0.0, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    _, seq = gspo_loss(logp, old, adv, mask)
    _, turn = gspo_turn_loss(logp, old, adv, mask)
    assert seq["ratio_max"] == pytest.approx(1.0)
    assert turn["ratio_max"] == pytest.approx(math.exp(0.5))
    assert turn["ratio_min"] == pytest.approx(math.exp(-0.5))


# ------------------------------------------------------------- refilling dynamic sampling


def test_refill_count_by_hand():
    # 8 wanted, 3 kept of 8 played: keep rate 3/8, shortfall 5 -> ceil(5 * 8 / 3) = 14,
    # cap 24 leaves 16 of room
    assert refill_count(kept=3, wanted=8, sampled=8, cap=24) == 14
    assert refill_count(kept=3, wanted=8, sampled=8, cap=16) == 8  # only the room is left
    assert refill_count(kept=0, wanted=8, sampled=8, cap=32) == 24  # nothing kept: rate 1/8 caps
    assert refill_count(kept=8, wanted=8, sampled=8, cap=32) == 0  # full
    assert refill_count(kept=3, wanted=8, sampled=16, cap=16) == 0  # cap reached
    assert refill_count(kept=6, wanted=8, sampled=8, cap=24, multiple=4) == 4  # ceil(2.67)->3->4
    assert refill_count(kept=1, wanted=8, sampled=8, cap=14, multiple=4) == 4  # room 6 -> 4


# ------------------------------------------------------------------------- curriculum


def test_record_groups_keeps_the_window():
    history = record_groups({}, ["a", "b"], [[1.0, 0.0], [0.8, 0.8]], window=2)
    assert history == {"a": [[1.0, 0.5]], "b": [[0.0, 0.8]]}
    history2 = record_groups(history, ["a", "a"], [[0.0, 0.0], [1.0, 1.0]], window=2)
    assert history2["a"] == [[0.0, 0.0], [0.0, 1.0]]
    assert history["a"] == [[1.0, 0.5]]  # the input is not changed


def test_task_weights_and_mastery():
    history = {
        "mixed": [[1.0, 0.2], [0.0, -1.0]],  # half mixed -> 0.2 + 0.8 * 0.5 = 0.6
        "mastered": [[1.0, 0.3], [0.0, 0.8], [0.0, 0.9]],  # last 2 equal at >= 0.5
        "hopeless": [[0.0, -1.0], [0.0, -1.0]],  # equal but low: floor 0.2, not retired
    }
    assert is_mastered(history["mastered"], 2, 0.5)
    assert not is_mastered(history["mastered"], 3, 0.5)
    assert not is_mastered(history["hopeless"], 2, 0.5)
    weights = task_weights(
        history,
        ["new", "mixed", "mastered", "hopeless"],
        retire_after=2,
        mastered_reward=0.5,
        floor=0.2,
    )
    assert weights == pytest.approx([1.0, 0.6, 0.0, 0.2])


def test_choose_tasks_prefers_weight_and_fills_from_retired():
    weights = [0.0, 1.0, 0.0, 0.05, 1.0]
    picks = [tuple(choose_tasks(weights, 2, seed)) for seed in range(200)]
    assert all(0 not in p and 2 not in p for p in picks)  # retired never while others remain
    assert picks.count((1, 4)) > 150  # the heavy two dominate
    assert choose_tasks(weights, 2, 7) == choose_tasks(weights, 2, 7)  # seeded
    filled = choose_tasks(weights, 4, 0)
    assert {1, 3, 4} <= set(filled) and len(filled) == 4
    with pytest.raises(ValueError):
        choose_tasks(weights, 6, 0)


# ------------------------------------------------------------- in the loop, tiny model


@pytest.fixture(scope="module")
def tiny_step():
    """The levers' config on the tiny model, its policy, env and player."""
    from looprl.config import config_from_dict
    from looprl.envs import make_env
    from looprl.loop.evaluate import player
    from looprl.loop.policy import load_policy

    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random"},
            "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
            "algo": {"dynamic_sampling": True, "max_oversample": 3.0},
            "curriculum": {"enabled": True, "candidates": 3, "window": 2},
        }
    )
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)
    return cfg, probe, player(cfg, policy, probe)


def test_play_step_refills_up_to_the_cap_and_records_the_curriculum(tiny_step):
    from looprl.loop.dist import Dist
    from looprl.loop.groups import play_step

    cfg, probe, play = tiny_step
    played, history = play_step(cfg, probe, play, Dist(), step=1, history={})
    group, wanted = cfg.rollout.group_size, cfg.rollout.tasks_per_step
    sampled = len(played.episodes) // group
    metrics = played.metrics
    assert metrics["train/oversample_ratio"] == sampled / wanted
    assert wanted <= sampled <= 6  # tasks_per_step × max_oversample
    groups = [played.advantages[i : i + group] for i in range(0, len(played.episodes), group)]
    rewards = [
        [e.reward for e in played.episodes[i : i + group]]
        for i in range(0, len(played.episodes), group)
    ]
    kept = [i for i, adv in enumerate(groups) if any(a is not None for a in adv)]
    assert metrics["train/kept_groups"] == len(kept) <= wanted
    assert all(len(set(rewards[i])) > 1 for i in kept)  # only groups with a spread train
    if len(kept) < wanted:
        assert sampled == 6  # it refilled until the cap
    else:
        assert kept[-1] == len(groups) - 1 or sampled == wanted  # it stopped once full
    # the curriculum remembered every group played, as [mixed, mean reward]
    played_ids = {e.task.id for e in played.episodes}
    assert set(history) == played_ids
    assert metrics["curriculum/tasks_seen"] == len(played_ids)
    # the same step from the same history plays the same episodes (a resumed run's step)
    again, history_again = play_step(cfg, probe, play, Dist(), step=1, history={})
    assert [e.reward for e in again.episodes] == [e.reward for e in played.episodes]
    assert history_again == history


def test_curriculum_history_survives_a_checkpoint(tmp_path):
    import json

    from looprl.loop.run_state import LoopState
    from looprl.loop.update import UpdateState

    state = LoopState(update=UpdateState(micro_batch_tokens=512))
    state.curriculum = record_groups({}, ["a", "b"], [[1.0, 0.0], [0.8, 0.8]], window=4)
    meta = json.loads(json.dumps(state.to_meta()))  # as checkpoint meta.json holds it
    restored = LoopState(update=UpdateState(micro_batch_tokens=2048))
    restored.load_meta(meta)
    assert restored.curriculum == state.curriculum and restored.update.micro_batch_tokens == 512
