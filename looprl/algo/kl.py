"""KL penalty to a frozen reference policy, as the losses add it (optional, `kl_coef`).

Per token, Schulman's k3 estimator of KL(pi || pi_ref); summed into the loss with the same
normaliser as the loss's policy-gradient part, so micro-batching stays exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from looprl.algo.logprobs import masked_mean, masked_sum

# log-ratios and log-differences are clamped to +-20 before exp: exp(20) ~ 4.9e8 is finite
# in float32/bf16 and far past any clip range
MAX_LOG_RATIO = 20.0


def k3_kl(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence").

    kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 >= 0, unbiased under samples of pi,
    zero iff ref_t == logp_t. The difference is clamped to [-20, 20] before exp.
    """
    d_BT = (ref_logp_BT.detach() - logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d_BT) - d_BT - 1.0


def kl_term(
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    m_BT: Tensor,
    normalizer: float | Tensor,
    per_sequence: bool,
) -> tuple[Tensor, Tensor]:
    """(KL contribution to the loss under `normalizer`, mean KL of this call for stats).

    per_sequence=True (gspo, gspo_token, dr_grpo):  sum_i mean_t kl_it / N_sequences
    per_sequence=False (grpo):                      sum_{i,t} kl_it / N_tokens
    The aggregation follows the loss's own normaliser, so micro-batching stays exact.
    """
    # zero both inputs off the mask *before* the nonlinearity: kl = 0 there, and a NaN/-inf
    # in the padding cannot turn the zero upstream gradient into 0 * nan
    zeros_BT = torch.zeros_like(logp_BT)
    kl_BT = k3_kl(
        torch.where(m_BT, logp_BT, zeros_BT), torch.where(m_BT, ref_logp_BT.detach(), zeros_BT)
    )
    if per_sequence:
        kl_B = masked_mean(kl_BT, m_BT, dim=-1)  # mean_t m_it kl_it, 0 for an empty row
        valid_B = m_BT.any(dim=-1)
        stat = kl_B.detach()[valid_B].mean() if valid_B.any() else kl_B.new_zeros(())
        return kl_B.sum() / normalizer, stat
    stat = masked_mean(kl_BT.detach(), m_BT)
    return masked_sum(kl_BT, m_BT) / normalizer, stat
