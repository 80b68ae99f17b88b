"""Group-relative advantages (GRPO family).

Every prompt is sampled G times; the G rewards form a *group*. A completion's advantage is
its reward relative to the others of its group, one scalar per sequence:

    A_i = (r_i - mean(r)) / (std(r) + eps)      scale=True   (GRPO, arXiv 2402.03300)
    A_i =  r_i - mean(r)                        scale=False  (Dr.GRPO, arXiv 2503.20783)

`std` is the *population* standard deviation (unbiased=False, divide by G): it is the
spread of the rewards actually observed, and it stays defined for G=1.

Dr.GRPO drops the division by std because it up-weights groups whose rewards barely
differ (nearly-solved or nearly-failed prompts), a difficulty bias.

A group whose rewards are all equal carries no learning signal: every advantage is 0,
set explicitly rather than computed, because `r - mean(r)` of equal floats can be a
rounding residue (~1e-9) that the division by a std of the same size would blow up.
DAPO's dynamic sampling (arXiv 2503.14476) drops such groups before the update.

Per-turn advantages (turn-level GSPO, algo/turns.py): where the environment also grades
each assistant turn (r_ik, turn k of episode i), turn k takes

    A_ik = A_i + w * (G_ik - mean(G)) / (std(G) + eps),   G_ik = sum_{j>=k} gamma^(j-k) r_ij

with A_i the episode advantage above, w = algo.turn_reward_weight and mean/std over every
turn of every episode of the group (DeepSeekMath's process supervision, arXiv 2402.03300,
sec. 4.1.3, with a discount). The episode reward still decides who won; the turn term
says which move did it. gamma = 0 credits a turn with its own grade only, the right choice
when a grade already looks ahead (tic-tac-toe's exact minimax). A group whose returns are
all equal gets no turn term, and one whose rewards and returns are all equal is still
dropped by dynamic sampling.

Expert baseline (`algo.experimental.expert_baseline: samples`, with expert guidance): a group of
policy samples s and expert episodes e takes

    A_s = the samples' own group advantages (as if no expert were there)
    A_e = max(0, r_e - mean(r_s)) / (std(r_s and r_e) + eps)

so the expert only pulls the policy toward its move where it beats the samples, and never
pushes the samples down: a group whose samples tie and lose to the expert trains on the
expert's episode alone (a supervised step weighted by how far the samples are behind). In
the default `group` baseline the expert is one member among the others, and seven samples
that tie below it take negative advantages that spread their probability off the square
they preferred (docs/learning/ablations.md, ablation 5). Per-turn terms are anchored the same way.

Entropy bonus (maximum-entropy RL): with b_i the surprisal -log pi of episode i's
decision tokens (as sampled) and beta = algo.experimental.entropy_coef,

    A_i += beta * (b_i - mean(b))        mean over the group, after the scaling above

which is the score-function estimate of beta times the gradient of the decisions' entropy,
E[-log pi], with the group mean as its baseline. It is not scaled by the rewards' std (that
would give a group of equal rewards a bonus of full size whatever beta). Among equal
rewards the choice sampled less often is pushed up; a group that played one choice
throughout has no spread (below BONUS_TOL) and gets nothing. Dynamic sampling keeps a
group whose rewards are equal but whose bonuses differ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _all_equal(rewards_G: Tensor) -> bool:
    return bool((rewards_G == rewards_G[0]).all())


def group_advantages(rewards_G: Tensor, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of one group of G rewards, shape [G].

    scale=True:  A = (r - mean) / (std + eps), std with unbiased=False (population).
    scale=False: A = r - mean (Dr.GRPO).
    A group of all-equal rewards (including G=1) gets exactly 0.
    """
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(f"rewards_G must be a non-empty 1-D tensor, got {tuple(rewards_G.shape)}")
    r_G = rewards_G if rewards_G.is_floating_point() else rewards_G.float()
    if _all_equal(r_G):
        return torch.zeros_like(r_G)
    centered_G = r_G - r_G.mean()  # r_i - mean(r)
    if not scale:
        return centered_G
    std = r_G.std(unbiased=False)  # sqrt(mean((r - mean)^2)), population std
    return centered_G / (std + eps)


def batch_advantages(rewards: list[list[float]], scale: bool = True) -> tuple[Tensor, Tensor]:
    """Advantages of many groups, each normalised within itself.

    Returns (adv_B, zero_std_mask_G): adv_B is float32, the groups' advantages concatenated
    in group order (B = total completions; groups may differ in size); zero_std_mask_G is a
    bool tensor, True for a group whose rewards are all equal (its advantages are 0).
    """
    adv_parts: list[Tensor] = []
    zero_std: list[bool] = []
    for group in rewards:
        r_G = torch.tensor(group, dtype=torch.float32)
        adv_parts.append(group_advantages(r_G, scale=scale))
        zero_std.append(_all_equal(r_G))
    adv_B = torch.cat(adv_parts) if adv_parts else torch.zeros(0)
    return adv_B, torch.tensor(zero_std, dtype=torch.bool)


def dynamic_sampling_keep(rewards: list[list[float]]) -> list[bool]:
    """DAPO dynamic sampling (arXiv 2503.14476): keep a group only if its rewards differ.

    An all-correct or all-wrong group has zero advantage everywhere, so it adds nothing to
    the gradient but still dilutes the batch; the caller drops it (and may resample).
    """
    return [len(set(group)) > 1 for group in rewards]


def turn_returns(rewards_K: list[float], gamma: float) -> list[float]:
    """G_k = sum_{j>=k} gamma^(j-k) r_j for each turn k of one episode."""
    returns: list[float] = []
    running = 0.0
    for r in reversed(rewards_K):
        running = r + gamma * running
        returns.append(running)
    return returns[::-1]


def group_turn_advantages(
    turn_rewards: list[list[float]], gamma: float, scale: bool = True, eps: float = 1e-6
) -> list[list[float]]:
    """The turn term of one group: each episode's returns G_ik, normalised over all the
    group's turns, (G - mean) / (std + eps) (population std; no division with scale=False).
    All returns equal (or no turn at all): zeros."""
    returns = [turn_returns(rewards_K, gamma) for rewards_K in turn_rewards]
    flat = [g for returns_K in returns for g in returns_K]
    if not flat or len(set(flat)) == 1:
        return [[0.0] * len(returns_K) for returns_K in returns]
    flat_U = torch.tensor(flat, dtype=torch.float64)
    mean, std = float(flat_U.mean()), float(flat_U.std(unbiased=False))
    div = std + eps if scale else 1.0
    return [[(g - mean) / div for g in returns_K] for returns_K in returns]


def anchored_advantages(
    samples: list[float], anchors: list[float], scale: bool = True, eps: float = 1e-6
) -> tuple[list[float], list[float]]:
    """The expert baseline (module doc): the samples' advantages among themselves, and each
    anchor's (expert's) lead over the samples' mean, floored at 0, over the std of all of
    them. No samples, or all values equal: zeros."""
    if not samples or len(set(samples + anchors)) == 1:
        return [0.0] * len(samples), [0.0] * len(anchors)
    adv_s = group_advantages(torch.tensor(samples, dtype=torch.float64), scale=scale, eps=eps)
    everything = torch.tensor(samples + anchors, dtype=torch.float64)
    div = float(everything.std(unbiased=False)) + eps if scale else 1.0
    mean = sum(samples) / len(samples)
    return adv_s.tolist(), [max(0.0, a - mean) / div for a in anchors]


Advantage = float | tuple[float, ...]  # one per episode, or one per turn (per-turn rewards)

# a group's bonus spread (nats) below which its episodes count as one choice: the same
# tokens after the same prompt, whose logprobs differ only by batching's rounding
BONUS_TOL = 1e-3


def bonus_terms(bonus_G: list[float], beta: float) -> list[float]:
    """beta * (b_i - mean b) for one group; all 0 when its spread is below BONUS_TOL."""
    if not bonus_G or max(bonus_G) - min(bonus_G) < BONUS_TOL:
        return [0.0] * len(bonus_G)
    mean = sum(bonus_G) / len(bonus_G)
    return [beta * (b - mean) for b in bonus_G]


def moves(advantage: Advantage | None) -> bool:
    """Whether an episode with this advantage can move the policy-gradient loss."""
    if advantage is None:
        return False
    if isinstance(advantage, tuple):
        return any(a != 0.0 for a in advantage)
    return advantage != 0.0


def episode_advantages(
    rewards: list[float],
    trainable: list[bool],
    group_size: int,
    *,
    turn_rewards: list[list[float]] | None = None,
    bonus: list[float] | None = None,
    anchors: list[bool] | None = None,
    **options: Any,
) -> tuple[list[Advantage | None], int]:
    """`group_advantages_of` over a flat batch whose consecutive runs of `group_size`
    episodes are one group each (the loop keeps its groups apart, loop/groups.py; this
    flat form is for callers holding plain lists). Returns every episode's advantage, in
    order, and the number of groups whose rewards are all equal."""
    n = len(rewards)
    for name, values in (
        ("turn reward lists", turn_rewards),
        ("bonuses", bonus),
        ("anchor flags", anchors),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{n} rewards but {len(values)} {name}")
    if len(trainable) != n or group_size < 1:
        raise ValueError(f"{n} rewards, {len(trainable)} trainable flags, group_size {group_size}")
    advantages: list[Advantage | None] = []
    zero_std = 0
    for i in range(0, n, group_size):
        part = slice(i, i + group_size)
        adv, all_equal = group_advantages_of(
            rewards[part],
            trainable[part],
            turn_rewards=None if turn_rewards is None else turn_rewards[part],
            bonus=None if bonus is None else bonus[part],
            anchors=None if anchors is None else anchors[part],
            **options,
        )
        advantages += adv
        zero_std += all_equal
    return advantages, zero_std


def group_advantages_of(
    rewards: list[float],
    trainable: list[bool],
    *,
    scale: bool = True,
    dynamic_sampling: bool = False,
    turn_rewards: list[list[float]] | None = None,
    turn_weight: float = 0.0,
    turn_gamma: float = 1.0,
    bonus: list[float] | None = None,
    bonus_weight: float = 0.0,
    anchors: list[bool] | None = None,
) -> tuple[list[Advantage | None], bool]:
    """The advantage of every episode of one task's group, None for one that takes no part.

    Only the entries flagged trainable count: their rewards form the group of
    `group_advantages` (normalised among themselves), the others get None. With
    `dynamic_sampling` a group whose rewards are all equal gets None throughout.
    With `turn_rewards` (each episode's per-turn rewards) and `turn_weight` > 0, each
    advantage is a tuple, one per graded turn: A_i + w * the group's normalised return of
    that turn (module doc); dynamic sampling then drops a group only when its rewards and
    its returns are all equal.
    With `bonus` (each episode's decision surprisal) and `bonus_weight` β > 0, every kept
    advantage (each turn's too) adds β × its bonus minus the group's mean bonus (module
    doc); dynamic sampling keeps a group whose bonuses spread.
    With `anchors` (True for an expert episode), the advantages and turn terms take the
    expert baseline (`anchored_advantages`): the samples' own, and each expert's lead over
    them floored at 0; dynamic sampling then keeps a group with any advantage not 0.
    Returns (advantages, all_equal): one entry per episode, in order, and whether the
    group has a trainable entry and its rewards are all equal (dropped or not).
    """

    graded = turn_rewards if turn_rewards is not None and turn_weight > 0 else None
    n = len(rewards)
    for name, values in (
        ("turn reward lists", graded),
        ("bonuses", bonus),
        ("anchor flags", anchors),
        ("trainable flags", trainable),
    ):
        if values is not None and len(values) != n:
            raise ValueError(f"{n} rewards but {len(values)} {name}")
    advantages: list[Advantage | None] = [None] * n
    members = [k for k in range(n) if trainable[k]]  # the others take no part
    if not members:
        return advantages, False
    own_rewards = [rewards[k] for k in members]
    rewards_G = torch.tensor(own_rewards, dtype=torch.float32)
    adv_G = group_advantages(rewards_G, scale=scale)
    keep = dynamic_sampling_keep([own_rewards])[0] if dynamic_sampling else True
    if anchors is not None:
        moving = _anchor(members, rewards, anchors, adv_G, scale)
        if dynamic_sampling:
            keep = moving  # the group keeps its place while an advantage in it is not 0
    turn_adv: dict[int, list[float]] = {}
    if graded is not None:
        if anchors is None:
            terms = group_turn_advantages([graded[k] for k in members], turn_gamma, scale)
            turn_adv = dict(zip(members, terms, strict=True))
        else:
            turn_adv = _anchored_turns(members, anchors, graded, turn_gamma, scale)
        if dynamic_sampling and any(t != 0.0 for term in turn_adv.values() for t in term):
            keep = True  # the returns differ: the turns still have something to learn
    extra: dict[int, float] = {}
    if bonus is not None and bonus_weight > 0:
        extra = dict(zip(members, bonus_terms([bonus[k] for k in members], bonus_weight)))
        if dynamic_sampling and any(extra.values()):
            keep = True  # different choices: the bonus has something to say
    if keep:
        for k, adv in zip(members, adv_G.tolist(), strict=True):
            adv += extra.get(k, 0.0)
            advantages[k] = tuple(adv + turn_weight * t for t in turn_adv[k]) if graded else adv
    return advantages, _all_equal(rewards_G)


def _anchor(
    members: list[int], rewards: list[float], anchors: list[bool], adv_G: Tensor, scale: bool
) -> bool:
    """Rewrite, in place, the advantages (adv_G, in `members`' order) of a group holding an
    anchor with the expert baseline; returns whether any of them is not 0."""
    own = [k for k in members if not anchors[k]]
    lead = [k for k in members if anchors[k]]
    if lead:
        adv_s, adv_e = anchored_advantages(
            [rewards[k] for k in own], [rewards[k] for k in lead], scale
        )
        values = dict(zip(own + lead, adv_s + adv_e, strict=True))
        for offset, k in enumerate(members):
            adv_G[offset] = values[k]
    return bool((adv_G != 0).any())


def _anchored_turns(
    group: list[int], anchors: list[bool], graded: list[list[float]], gamma: float, scale: bool
) -> dict[int, list[float]]:
    """The turn terms of one group under the expert baseline: every turn's return, the
    samples' turns normalised among themselves, each expert turn's lead over their mean
    (a group without an expert: the plain group normalisation)."""
    own = [k for k in group if not anchors[k]]
    lead = [k for k in group if anchors[k]]
    returns = {k: turn_returns(graded[k], gamma) for k in group}
    flat_s = [g for k in own for g in returns[k]]
    flat_e = [g for k in lead for g in returns[k]]
    adv_s, adv_e = anchored_advantages(flat_s, flat_e, scale)
    terms: dict[int, list[float]] = {}
    for keys, flat in ((own, adv_s), (lead, adv_e)):
        at = 0
        for k in keys:
            terms[k] = flat[at : at + len(returns[k])]
            at += len(returns[k])
    return terms
