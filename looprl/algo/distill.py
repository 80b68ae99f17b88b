"""On-policy distillation (`algo.name: opd`, or `algo.distill_coef` beside any loss):
the student samples, a teacher scores the student's own tokens, and each token is pushed
along the reverse KL(pi || pi_teacher) (as TRL's DistillationTrainer, prime-rl's `opd` and
tinker-cookbook's recipe do).

Per token, the reverse KL's one-sample estimate under the policy that sampled is
d_it = old_it - teacher_it (k1), and its negative is the token's advantage:

    A_it = -(old_it - teacher_it)                                      (no gradient)
    r_it = exp(logp_it - old_it)
    L    = - sum_{i,t} m_it min(r_it A_it, clip(r_it, 1-eps_low, 1+eps_high) A_it) / N_tok

At r = 1 the gradient is sum_t (old_t - teacher_t) grad log pi_t / N_tok: the per-token
reverse KL's gradient, each token credited with its own term only (no discount over later
tokens). The teacher and the student must share a tokenizer: the log-probs compared are
those of the same token ids (loop/teacher.py refuses a mismatch).

Stats: `distill_kl`, the mean of d_it over the masked tokens (the reverse KL estimate, the
figure that falls as the student learns), plus the usual clip stats over tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO
from looprl.algo.logprobs import masked_mean, masked_sum
from looprl.algo.loss_parts import _clipped_objective, _masked_log_ratio, _stats
from looprl.algo.losses import Normalizer


def opd_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    teacher_logp_BT: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    normalizer: Normalizer | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The distillation loss of one call (module doc) and its stats."""
    if not logp_BT.shape == old_logp_BT.shape == teacher_logp_BT.shape == mask_BT.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp_BT.shape)}, old {tuple(old_logp_BT.shape)}, "
            f"teacher {tuple(teacher_logp_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    m_BT = mask_BT.bool()
    n = (normalizer or Normalizer.of(mask_BT)).tokens  # N_tok
    zeros_BT = torch.zeros_like(logp_BT)
    d_BT = torch.where(m_BT, old_logp_BT.detach() - teacher_logp_BT.detach(), zeros_BT)
    adv_BT = -d_BT  # A_it
    log_r_BT = _masked_log_ratio(logp_BT, old_logp_BT, m_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r_BT = torch.exp(log_r_BT)
    obj_BT, clip_active_BT = _clipped_objective(r_BT, adv_BT, eps_low, eps_high)
    loss = -masked_sum(obj_BT, m_BT) / n
    stats = _stats(r_BT[m_BT], clip_active_BT[m_BT], loss, None)
    stats["distill_kl"] = float(masked_mean(d_BT, m_BT))
    return loss, stats
