"""CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): REINFORCE with a clipped, detached
importance weight, normalised over tokens.

    r_it = exp(logp_it - old_it)
    L    = - sum_{i,t} m_it sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_i logp_it / N_tok

Unlike the PPO-style clip of `losses.py`, a token whose ratio left the range keeps its
gradient: the clip bounds the weight, it never zeroes the token (the paper's argument: the
rare tokens that decide a reasoning path are the ones a PPO clip drops after one update).
The paper sets no lower bound and tunes the upper one: the defaults are eps_low = 1 (the
weight is floored at 0, i.e. not at all) and eps_high = 0.28 (config/algo.py DEFAULT_CLIP).

dL/dlogp_it = - m_it clip(r_it) A_i / N_tok. The loss's value is not a surrogate of the
reward (it is the advantage-weighted log-likelihood), so compare `loss` across algorithms
with care; `clip_frac` counts the tokens whose weight was clipped (their gradient flows,
scaled to the bound).
"""

from __future__ import annotations

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO
from looprl.algo.loss_parts import _check_shapes, _finish, _masked_log_ratio
from looprl.algo.losses import Normalizer


def cispo_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    ref_logp_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: Normalizer | None = None,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """CISPO's token-mean loss (module doc); the same call as every loss in `LOSSES`."""
    _check_shapes(logp_BT, old_logp_BT, adv_B, mask_BT)
    m_BT = mask_BT.bool()
    n = (normalizer or Normalizer.of(mask_BT)).tokens  # N_tok
    adv_B = adv_B.detach().to(logp_BT.dtype)

    log_r_BT = _masked_log_ratio(logp_BT, old_logp_BT, m_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r_BT = torch.exp(log_r_BT).detach()
    w_BT = r_BT.clamp(max(1.0 - eps_low, 0.0), 1.0 + eps_high)  # sg(clip(r))
    clipped_BT = (r_BT < 1.0 - eps_low) | (r_BT > 1.0 + eps_high)
    lp_BT = torch.where(m_BT, logp_BT, torch.zeros_like(logp_BT))
    pg_loss = -(w_BT * adv_B[:, None] * lp_BT).sum() / n

    return _finish(
        pg_loss,
        logp_BT,
        ref_logp_BT,
        m_BT,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        normalizer=n,
        per_sequence=False,
        ratio_U=r_BT[m_BT],
        clip_active_U=clipped_BT[m_BT],
    )
