"""KL penalty to a frozen reference policy, as the losses add it (optional, `kl_coef`).

Three estimators of the reverse KL(pi || pi_ref) from tokens sampled by pi (Schulman,
"Approximating KL divergence"), with log r_t = log pi_ref(y_t) - log pi(y_t):

    k1 = -log r                 unbiased, can be negative per token
    k2 = (log r)^2 / 2          biased (close for close policies), >= 0
    k3 = r - 1 - log r          unbiased, >= 0   (the default: `algo.kl_estimator`)

How each enters the loss matters more than its value (arXiv 2512.21852):
- k2 and k3 are added to the loss and differentiated through log pi. k2's gradient,
  (log pi - log pi_ref) grad log pi, is on average the reverse KL's gradient. k3's,
  (1 - r) grad log pi, is on average the gradient of the *forward* KL(pi_ref || pi).
- k1 is taken "in the reward": a REINFORCE term sg(k1_i) * grad log pi(y_i) with k1_i the
  sequence's estimate, whose mean is exactly the reverse KL's gradient (the score
  function: grad E[f] = E[f grad log pi] + E[grad f], and E[grad k1] = E[grad log pi] = 0).
  Written as sg(k1_i) * (1 + sum_t (log pi_t - sg(log pi_t))), its value is the estimate.

Each is summed into the loss with the loss's own normaliser, so micro-batching stays exact.
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


def kl_tokens(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: str) -> Tensor:
    """Per-token k1, k2 or k3 (module doc); k1 without gradient (it is a reward)."""
    if estimator == "k3":
        return k3_kl(logp_BT, ref_logp_BT)
    log_r_BT = (ref_logp_BT.detach() - logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k2":
        return 0.5 * log_r_BT.square()
    if estimator == "k1":
        return -log_r_BT.detach()
    raise ValueError(f"unknown KL estimator {estimator!r}: one of k1, k2, k3")


def kl_term(
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    m_BT: Tensor,
    normalizer: float | Tensor,
    per_sequence: bool,
    estimator: str = "k3",
) -> tuple[Tensor, Tensor]:
    """(KL contribution to the loss under `normalizer`, mean KL of this call for stats).

    per_sequence=True (gspo, gspo_token, dr_grpo):  sum_i mean_t kl_it / N_sequences
    per_sequence=False (grpo, cispo):               sum_{i,t} kl_it / N_tokens
    The aggregation follows the loss's own normaliser, so micro-batching stays exact.
    k1 enters as the REINFORCE term of the module doc, aggregated the same way.
    """
    # zero both inputs off the mask *before* the nonlinearity: kl = 0 there, and a NaN/-inf
    # in the padding cannot turn the zero upstream gradient into 0 * nan
    zeros_BT = torch.zeros_like(logp_BT)
    logp_BT = torch.where(m_BT, logp_BT, zeros_BT)
    kl_BT = kl_tokens(logp_BT, torch.where(m_BT, ref_logp_BT.detach(), zeros_BT), estimator)
    if estimator == "k1":
        return _reward_term(kl_BT, logp_BT, m_BT, normalizer, per_sequence)
    if per_sequence:
        kl_B = masked_mean(kl_BT, m_BT, dim=-1)  # mean_t m_it kl_it, 0 for an empty row
        valid_B = m_BT.any(dim=-1)
        stat = kl_B.detach()[valid_B].mean() if valid_B.any() else kl_B.new_zeros(())
        return kl_B.sum() / normalizer, stat
    stat = masked_mean(kl_BT.detach(), m_BT)
    return masked_sum(kl_BT, m_BT) / normalizer, stat


def _reward_term(
    k1_BT: Tensor, logp_BT: Tensor, m_BT: Tensor, normalizer: float | Tensor, per_sequence: bool
) -> tuple[Tensor, Tensor]:
    """k1 in the reward: sum_i sg(k1_i) (1 + sum_t m_it (logp_it - sg logp_it)) / N, with
    k1_i the row's mean k1 (per_sequence) or its sum over tokens (token-mean losses, N the
    token count): value sum_i k1_i / N, gradient the reverse KL's (module doc)."""
    score_B = masked_sum(logp_BT - logp_BT.detach(), m_BT, dim=-1)  # value 0, grad sum_t
    if per_sequence:
        k1_B = masked_mean(k1_BT, m_BT, dim=-1)
        valid_B = m_BT.any(dim=-1)
        stat = k1_B[valid_B].mean() if valid_B.any() else k1_B.new_zeros(())
    else:
        k1_B = masked_sum(k1_BT, m_BT, dim=-1)
        stat = masked_mean(k1_BT, m_BT)
    return (k1_B * (1.0 + score_B)).sum() / normalizer, stat
