"""Turn-level GSPO: one importance ratio per assistant turn of a multi-turn episode.

A multi-turn episode's tokens alternate: the model's turns (loss mask 1) and what the
environment inserted between them (mask 0). Each maximal run of masked tokens is one
assistant turn, so the turn boundaries are read off the mask; nothing else is needed.

Sequence-level GSPO (losses.gspo_loss) takes one ratio per episode, the geometric mean
over all its generated tokens: a long game's first move and its last share one ratio, and
one turn far off-policy clips the whole episode. Step-wise training (as in SkyRL) treats
each turn as its own sample instead:

    s_ik  = exp( sum_{t in turn k} (logp_it - old_it) / |turn k| )     (exp of the mean)
    obj_i = (1/K_i) sum_k min(s_ik A_ik, clip(s_ik, 1-eps_low, 1+eps_high) A_ik)
    L     = - sum_i obj_i / N_seq

with K_i the number of turns of episode i. By default every turn takes the episode's
advantage (A_ik = A_i); where the environment grades each turn and algo.turn_reward_weight
> 0, A_ik differs per turn (algo/advantages.py) and arrives as a [B, K] tensor. Averaging
over the turns keeps an episode's weight in the batch independent of its length, as GSPO's
per-sequence mean does; with one turn per episode this IS sequence-level GSPO, in value and
in gradient. clip_frac and the ratio stats count turns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO
from looprl.algo.loss_parts import (
    _check_shapes,
    _clipped_objective,
    _finish,
    _masked_log_ratio,
)
from looprl.algo.losses import Normalizer


def turn_ids(mask_BT: Tensor) -> Tensor:
    """The turn of every masked token, 1, 2, ... per row (0 off the mask), shape [B, T].

    A turn is a maximal run of masked tokens: it starts where the mask is 1 and the
    token before it is 0 (or it is the row's first token)."""
    m_BT = mask_BT.bool()
    before_BT = torch.nn.functional.pad(m_BT[:, :-1], (1, 0), value=False)
    starts_BT = m_BT & ~before_BT
    return torch.where(
        m_BT, starts_BT.long().cumsum(dim=-1), torch.zeros_like(m_BT, dtype=torch.long)
    )


def turn_log_ratios(logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """log s_ik, the mean log-ratio over each turn's tokens, [B, K], and valid_BK (the
    turn exists); K = the most turns any row has. Clamped like the sequence ratio."""
    m_BT = mask_BT.bool()
    turn_BT = turn_ids(m_BT)
    k = int(turn_BT.max()) if turn_BT.numel() else 0
    diff_BT = _masked_log_ratio(logp_BT, old_logp_BT, m_BT)
    # slot 0 collects the unmasked positions (all zero) and is dropped
    sums_BK = diff_BT.new_zeros(diff_BT.shape[0], k + 1).scatter_add(1, turn_BT, diff_BT)
    lens_BK = diff_BT.new_zeros(diff_BT.shape[0], k + 1).scatter_add(
        1, turn_BT, m_BT.to(diff_BT.dtype)
    )
    sums_BK, lens_BK = sums_BK[:, 1:], lens_BK[:, 1:]
    log_s_BK = sums_BK / lens_BK.clamp(min=1)  # (1/|turn k|) sum_{t in k} (logp - old)
    return log_s_BK.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), lens_BK > 0


def gspo_turn_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    ref_logp_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: Normalizer | None = None,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """Turn-level GSPO (module doc): L = - sum_i (1/K_i) sum_k min(s_ik A_ik, clip(s_ik) A_ik) / N.

    `adv_B` is one advantage per episode, [B] (A_ik = A_i), or one per turn, [B, K'] (turn
    k of row i takes column k; turns past K' take 0). Default eps as sequence-level GSPO
    (a turn ratio is a mean over its tokens too). A row with an all-zero mask has no turn
    and contributes 0."""
    per_turn = adv_B.dim() == 2
    _check_shapes(logp_BT, old_logp_BT, adv_B.sum(dim=1) if per_turn else adv_B, mask_BT)
    m_BT = mask_BT.bool()
    n = (normalizer or Normalizer.of(mask_BT)).sequences  # N_seq
    adv_B = adv_B.detach().to(logp_BT.dtype)

    log_s_BK, valid_BK = turn_log_ratios(logp_BT, old_logp_BT, m_BT)
    s_BK = torch.exp(log_s_BK)
    if per_turn:  # A_ik from the turn's column, 0 past the given ones
        k, given = s_BK.shape[1], adv_B.shape[1]
        adv_BK = adv_B[:, :k] if given >= k else torch.nn.functional.pad(adv_B, (0, k - given))
    else:
        adv_BK = adv_B[:, None].expand_as(s_BK)  # A_ik = A_i
    obj_BK, clip_active_BK = _clipped_objective(s_BK, adv_BK, eps_low, eps_high)
    obj_BK = torch.where(valid_BK, obj_BK, torch.zeros_like(obj_BK))
    turns_B = valid_BK.sum(dim=-1).clamp(min=1).to(obj_BK.dtype)  # K_i
    pg_loss = -(obj_BK.sum(dim=-1) / turns_B).sum() / n

    return _finish(
        pg_loss,
        logp_BT,
        ref_logp_BT,
        m_BT,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        normalizer=n,
        per_sequence=True,
        ratio_U=s_BK[valid_BK],
        clip_active_U=clip_active_BK[valid_BK],
    )
