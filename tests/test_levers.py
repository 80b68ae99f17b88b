"""Tests of the learning levers' pure parts: turn-level GSPO, refilling dynamic sampling
and the task curriculum (looprl/algo/turns.py, looprl/algo/selection.py)."""

from __future__ import annotations

import math

import pytest
import torch

from looprl.algo import (
    choose_tasks,
    episode_advantages,
    group_turn_advantages,
    gspo_loss,
    gspo_turn_loss,
    is_mastered,
    record_groups,
    refill_count,
    task_weights,
    turn_ids,
    turn_returns,
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


# ------------------------------------------------------------------ per-turn advantages


def test_turn_returns_by_hand():
    # G_2 = -1; G_1 = 0 + 0.5 * -1 = -0.5; G_0 = 1 + 0.5 * -0.5 = 0.75
    assert turn_returns([1.0, 0.0, -1.0], 0.5) == [0.75, -0.5, -1.0]
    assert turn_returns([1.0, 0.0, -1.0], 0.0) == [1.0, 0.0, -1.0]  # each turn its own
    assert turn_returns([1.0, 0.0, -1.0], 1.0) == [0.0, -1.0, -1.0]  # the plain sum
    assert turn_returns([], 0.9) == []


def test_group_turn_advantages_by_hand():
    # gamma 0: returns [1, 1], [1, -1]; mean 0.5, population std sqrt(3)/2
    std = math.sqrt(3) / 2
    got = group_turn_advantages([[1.0, 1.0], [1.0, -1.0]], gamma=0.0)
    want = [[0.5 / std, 0.5 / std], [0.5 / std, -1.5 / std]]
    assert got == [pytest.approx(w, rel=1e-5) for w in want]
    # unscaled: only centred
    assert group_turn_advantages([[1.0, 1.0], [1.0, -1.0]], 0.0, scale=False) == [
        [0.5, 0.5], [0.5, -1.5],
    ]  # fmt: skip
    # all returns equal, or an episode with no turn: zeros of the right shapes
    assert group_turn_advantages([[1.0], [1.0, 1.0], []], gamma=0.0) == [[0.0], [0.0, 0.0], []]


def test_episode_advantages_with_turn_rewards():
    # group 0: both episodes draw (reward 0, no spread) but episode 1 blundered and
    # recovered (grades 1, 0, 1): dropped on rewards alone, kept on its turns
    # group 1: a win and a loss, every move graded 1 except the loser's last
    rewards = [0.0, 0.0, 1.0, -1.0]
    turns = [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0], [1.0, 1.0, 0.0]]
    plain, zero = episode_advantages(rewards, [True] * 4, 2, dynamic_sampling=True)
    assert plain[:2] == [None, None] and zero == 1
    adv, zero = episode_advantages(
        rewards, [True] * 4, 2, dynamic_sampling=True,
        turn_rewards=turns, turn_weight=0.5, turn_gamma=0.0,
    )  # fmt: skip
    assert zero == 1  # still counted on the rewards
    t0 = group_turn_advantages(turns[:2], 0.0)
    t1 = group_turn_advantages(turns[2:], 0.0)
    a_win, a_loss = plain[2], plain[3]
    assert adv[0] == pytest.approx(tuple(0.0 + 0.5 * t for t in t0[0]))
    assert adv[1] == pytest.approx(tuple(0.5 * t for t in t0[1]))
    assert adv[1][1] < 0 < adv[1][0]  # the blunder, and only it, is pushed down
    assert adv[2] == pytest.approx(tuple(a_win + 0.5 * t for t in t1[0]))
    assert adv[3] == pytest.approx(tuple(a_loss + 0.5 * t for t in t1[1]))
    assert adv[3][2] < adv[3][0] < 0  # the losing move carries the most blame
    # weight 0: exactly the episode advantages, as floats
    same, _ = episode_advantages(rewards, [True] * 4, 2, turn_rewards=turns, turn_weight=0.0)
    assert same == episode_advantages(rewards, [True] * 4, 2)[0]
    with pytest.raises(ValueError, match="turn reward lists"):
        episode_advantages(rewards, [True] * 4, 2, turn_rewards=turns[:3], turn_weight=1.0)


def test_gspo_turn_takes_one_advantage_per_turn():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 8, generator=g, dtype=torch.float64)
    logp = (old + 0.2 * torch.randn(3, 8, generator=g, dtype=torch.float64)).requires_grad_(True)
    # row 0: three turns; row 1: two; row 2: one
    mask = torch.tensor(
        [[1, 1, 0, 1, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]],
        dtype=torch.float64,
    )
    kw = {"eps_low": 0.1, "eps_high": 0.1}
    adv_B = torch.tensor([0.7, -1.2, 0.3], dtype=torch.float64)
    # equal columns: the same loss and gradient as one advantage per episode
    l_b, _ = gspo_turn_loss(logp, old, adv_B, mask, **kw)
    (g_b,) = torch.autograd.grad(l_b, logp)
    l_bk, _ = gspo_turn_loss(logp, old, adv_B[:, None].expand(3, 3).clone(), mask, **kw)
    (g_bk,) = torch.autograd.grad(l_bk, logp)
    torch.testing.assert_close(l_bk, l_b, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_bk, g_b, rtol=0, atol=1e-12)
    # distinct columns, by hand: L = -sum_i (1/K_i) sum_k min(s A, clip(s) A) / 3
    adv_BK = torch.tensor([[1.0, -1.0, 2.0], [0.5, -0.5, 9.0], [-1.0, 9.0, 9.0]],
                          dtype=torch.float64)  # fmt: skip
    diff = (logp - old).detach()
    turns = [[[0, 1], [3], [5, 6]], [[1, 2, 3], [6]], [[0, 1, 2]]]
    want = 0.0
    for i, row in enumerate(turns):
        objs = []
        for k, idx in enumerate(row):
            s_ik = math.exp(float(diff[i, idx].mean()))
            a = float(adv_BK[i, k])
            objs.append(min(s_ik * a, min(max(s_ik, 0.9), 1.1) * a))
        want += sum(objs) / len(objs)
    loss, stats = gspo_turn_loss(logp, old, adv_BK, mask, **kw)
    assert loss.item() == pytest.approx(-want / 3, rel=1e-12)
    assert stats["count"] == 6.0
    # fewer columns than turns: the missing turns take 0; more: ignored
    short, _ = gspo_turn_loss(logp, old, adv_BK[:, :2], mask, **kw)
    padded = torch.cat([adv_BK[:, :2], torch.zeros(3, 1, dtype=torch.float64)], dim=1)
    assert short.item() == pytest.approx(gspo_turn_loss(logp, old, padded, mask, **kw)[0].item())
    wide = torch.cat([adv_BK, torch.full((3, 2), 5.0, dtype=torch.float64)], dim=1)
    assert gspo_turn_loss(logp, old, wide, mask, **kw)[0].item() == pytest.approx(loss.item())


def test_advantage_tensor_pads_per_turn_rows():
    from looprl.loop.update import advantage_tensor

    assert advantage_tensor([0.5, -1.0]).tolist() == [0.5, -1.0]
    got = advantage_tensor([(1.0, 2.0, 3.0), (4.0,), 0.5])
    assert got.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.5, 0.0, 0.0]]


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
    from looprl.loop.play import player
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
    groups = played.groups
    assert [len(g.episodes) for g in groups] == [group] * sampled
    assert all(e.task is g.task for g in groups for e in g.episodes)
    kept = [i for i, g in enumerate(groups) if g.kept]
    assert metrics["train/kept_groups"] == len(kept) <= wanted
    # only groups with a spread train
    assert all(len({e.reward for e in groups[i].episodes}) > 1 for i in kept)
    # the rounds were the ones refill_count asks for after each (a round's groups play in
    # parallel): it refilled while short and under the cap, and stopped once full
    played_so_far, count = 0, wanted
    while count:
        played_so_far += count
        assert played_so_far <= sampled
        kept_so_far = min(sum(g.kept for g in groups[:played_so_far]), wanted)
        count = refill_count(kept_so_far, wanted, played_so_far, 6)
    assert played_so_far == sampled
    if len(kept) < wanted:
        assert sampled == 6  # it refilled until the cap
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


def test_play_step_gives_per_turn_advantages_on_a_graded_game():
    """tictactoe-game with move_rewards on the tiny model: every kept episode gets one
    advantage per turn, built from its own grades, and an update learns from them."""
    from looprl.config import config_from_dict
    from looprl.envs import make_env
    from looprl.loop.dist import Dist
    from looprl.loop.groups import play_step
    from looprl.loop.optim import make_optimizer
    from looprl.loop.play import player
    from looprl.loop.policy import load_policy
    from looprl.loop.update import UpdateState, update_policy

    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random"},
            "env": {"name": "tictactoe-game", "args": {"opponent": "random", "move_rewards": True}},
            "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
            "algo": {"name": "gspo_turn", "turn_reward_weight": 1.0, "turn_gamma": 0.0},
        }
    )
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)
    played, _ = play_step(cfg, probe, player(cfg, policy, probe), Dist(), step=1, history={})
    graded = [e for e in played.episodes if e.trainable]
    assert graded and all(len(e.turn_rewards) == len(e.turns) for e in graded)
    for e, a in played.learners():
        assert isinstance(a, tuple) and len(a) == len(e.turns)
    assert played.learners()
    optimizer = make_optimizer(policy.trainable_parameters(), "adamw", 1e-3, 0.0)
    stats = update_policy(
        policy, optimizer, played.groups, cfg.algo, cfg.train, group_size=4, max_tokens=32 * 5,
        seed=0, state=UpdateState(micro_batch_tokens=cfg.train.micro_batch_tokens),
    )  # fmt: skip
    assert stats["updated"] >= 1 and math.isfinite(stats["loss"])


# ------------------------------------------------------------- entropy bonus


def test_bonus_terms_by_hand():
    from looprl.algo import bonus_terms

    assert bonus_terms([1.0, 3.0], 0.5) == [-0.5, 0.5]
    assert bonus_terms([0.2, 0.2, 1.1], 1.0) == pytest.approx([-0.3, -0.3, 0.6])
    assert bonus_terms([0.7, 0.7 + 1e-5], 1.0) == [0.0, 0.0]  # one choice, rounding apart
    assert bonus_terms([], 1.0) == []


def test_episode_advantages_with_an_entropy_bonus():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    bonus = [0.5, 0.5, 2.0, 0.5, 1.0, 3.0, 0.7, 0.7]
    ok = [True] * 8
    plain, zero_std = episode_advantages(rewards, ok, 2)
    with_bonus, zero_std_b = episode_advantages(rewards, ok, 2, bonus=bonus, bonus_weight=0.1)
    assert zero_std == zero_std_b == 3  # counted on the rewards
    # group 1: rewards differ, bonuses equal: as before
    assert with_bonus[:2] == pytest.approx(plain[:2])
    # group 2 (0, 0) and 3 (0, 0): the rarer choice pushed up by 0.1 x the spread, unscaled
    assert with_bonus[2:4] == pytest.approx([0.0 + 0.1 * 0.75, 0.0 - 0.1 * 0.75])
    assert with_bonus[4:6] == pytest.approx([-0.1, 0.1])
    # group 4: equal rewards, one choice: nothing
    assert with_bonus[6:] == [0.0, 0.0]
    # dynamic sampling keeps the groups whose bonuses spread, drops the last
    kept, _ = episode_advantages(
        rewards, ok, 2, dynamic_sampling=True, bonus=bonus, bonus_weight=0.1
    )
    assert kept[2:6] == pytest.approx(with_bonus[2:6]) and kept[6:] == [None, None]
    # beta 0: exactly the old floats; per-turn tuples take the term on every turn
    assert episode_advantages(rewards, ok, 2, bonus=bonus, bonus_weight=0.0)[0] == plain
    turns = [[1.0], [0.0], [1.0, 1.0], [1.0], [0.0], [0.0], [1.0], [1.0]]
    per_turn, _ = episode_advantages(
        rewards, ok, 2, turn_rewards=turns, turn_weight=1.0, bonus=bonus, bonus_weight=0.1
    )
    assert per_turn[4] == pytest.approx((-0.1,)) and per_turn[5] == pytest.approx((0.1,))
    with pytest.raises(ValueError, match="bonuses"):
        episode_advantages(rewards, ok, 2, bonus=bonus[:3], bonus_weight=0.1)


# ------------------------------------------------------------------ the greedy eval's tasks


def test_greedy_eval_tasks_extend_the_sampled_evals_and_each_is_played_once():
    """The greedy eval plays as many distinct held-out tasks as the sampled eval plays
    episodes (`eval.greedy_tasks` unset), or `eval.greedy_tasks` of them: the sampled
    eval's tasks first, then more drawn with eval.seed, at most the env's held-out set
    (tictactoe-game: 64 games); each one once, since a second greedy episode of a task
    would be the same episode."""
    from looprl.config import config_from_dict
    from looprl.envs import make_env
    from looprl.errors import ConfigError
    from looprl.loop.evaluate import evaluate, greedy_eval_tasks, kept_tasks
    from looprl.types import Episode

    def with_eval(**fields):
        return config_from_dict({"env": {"name": "tictactoe-game"}, "eval": {"tasks": 8, **fields}})

    cfg = with_eval()
    env = make_env(cfg.env.name, cfg.env.args)
    eval_tasks = env.tasks("eval", n=8, seed=cfg.eval.seed)
    ids = [t.id for t in eval_tasks]
    default = greedy_eval_tasks(env, cfg, eval_tasks)  # 8 tasks × 4 samples: 32 tasks
    assert len({t.id for t in default}) == len(default) == 32 and [t.id for t in default[:8]] == ids
    assert [t.id for t in greedy_eval_tasks(env, with_eval(greedy_tasks=5), eval_tasks)] == ids[:5]
    tasks = greedy_eval_tasks(env, with_eval(greedy_tasks=100), eval_tasks)
    assert len({t.id for t in tasks}) == len(tasks) == 64 and [t.id for t in tasks[:8]] == ids
    assert {t.id for t in tasks} == {t.id for t in env.tasks("eval", n=None)}

    played, temperatures = [], []

    def play(batch, params, on_progress=None, first_index=0):
        played.append([t.id for t in batch])
        temperatures.append(params.temperature)
        return [Episode(t, [], [], [], [], reward=1.0, outcome="win") for t in batch]

    twice = eval_tasks + eval_tasks  # a task list with repeats: each task once, in order
    greedy = evaluate(None, play, twice, cfg, None, "baseline_greedy", greedy=True)
    assert played[0] == ids and greedy["n"] == 8 and temperatures[0] == 0.0
    sampled = evaluate(None, play, eval_tasks, cfg, None, "baseline")
    assert sampled["n"] == 8 * 4 and temperatures[1] == 1.0  # eval.samples_per_task = 4
    # resumed: the tasks the kept greedy baseline played, in its order, whatever the settings
    kept = {"task_ids": [t.id for t in reversed(default[:10])]}
    assert [t.id for t in kept_tasks(kept, tasks[:3], default)] == kept["task_ids"]
    assert kept_tasks({"task_ids": ["game-eval-nope"]}, tasks[:3], default) == tasks[:3]
    with pytest.raises(ConfigError, match="greedy_tasks"):
        config_from_dict({"eval": {"greedy_tasks": 0}})


# ------------------------------------------------------------------ the greedy member


def test_play_step_makes_one_member_of_each_group_the_greedy_episode(tiny_step):
    """`algo.greedy_samples: 1`: the last member of each group is the policy's greedy
    episode of the task (T = 0: the same as a greedy episode played on its own), the
    others are sampled; it takes an advantage like any member."""
    from looprl.config import config_from_dict
    from looprl.engine import SamplingParams
    from looprl.loop.dist import Dist
    from looprl.loop.groups import greedy_member, play_step

    base, probe, play = tiny_step
    cfg = config_from_dict(
        {
            **base.model_dump(),
            "algo": {"greedy_samples": 1},
            "curriculum": {"enabled": False},
        }
    )
    played, _ = play_step(cfg, probe, play, Dist(), step=1, history={})
    group = cfg.rollout.group_size
    assert len(played.episodes) == cfg.rollout.tasks_per_step * group
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    for members in (g.episodes for g in played.groups):
        assert [greedy_member(cfg, e) for e in members] == [False] * (group - 1) + [True]
        assert [e.temperature for e in members[:-1]] == [1.0] * (group - 1)
        alone = play([members[-1].task], params=greedy)[0]
        assert alone.token_ids == members[-1].token_ids and alone.reward == members[-1].reward
    assert not greedy_member(base, played.episodes[group - 1])  # off: nothing is a member
