"""The losses of Tinker's training API (`forward_backward(data, loss_fn=...)`), as the
Tinker documentation publishes them (tinker-docs.thinkingmachines.ai/tinker/losses/, one
page per loss, each with the PyTorch lines the service runs).

Every loss is over one datum's positions: `logp_T` are the trainer's logprobs of the
datum's `target_tokens`, `sampling_logp_T` (the `logprobs` input, q) the sampler's, `adv_T`
the advantages. Each returns the datum's loss summed over its positions, never averaged:
the caller (the SDK user) chooses the normalisation through the weights or advantages it
sends. The server adds the datums' losses and reports the sum as the metric `loss:sum`.

`stable_reinforce` is not here: its objective is not published.
"""

from __future__ import annotations

from torch import Tensor


def cross_entropy(logp_T: Tensor, weights_T: Tensor) -> Tensor:
    """loss = −Σ_t w_t · log p(x_t). Signed weights are allowed: the SDK runs a custom loss
    client-side as this loss with w = −∂C/∂logp."""
    return -(logp_T * weights_T).sum()


def importance_sampling(logp_T: Tensor, sampling_logp_T: Tensor, adv_T: Tensor) -> Tensor:
    """loss = −Σ_t (p_θ(x_t) / q(x_t)) · A_t, the ratio exp(logp − q)."""
    ratio_T = (logp_T - sampling_logp_T).exp()
    return -(ratio_T * adv_T).sum()


def ppo(
    logp_T: Tensor,
    sampling_logp_T: Tensor,
    adv_T: Tensor,
    clip_low: float,
    clip_high: float,
) -> Tensor:
    """loss = −Σ_t min(r_t · A_t, clip(r_t, clip_low, clip_high) · A_t), r_t = exp(logp − q).
    The thresholds bound the ratio itself (0.8 and 1.2 for the documented ε = 0.2)."""
    ratio_T = (logp_T - sampling_logp_T).exp()
    clipped_T = ratio_T.clamp(clip_low, clip_high)
    return -(ratio_T * adv_T).minimum(clipped_T * adv_T).sum()


def cispo(
    logp_T: Tensor,
    sampling_logp_T: Tensor,
    adv_T: Tensor,
    clip_low: float,
    clip_high: float,
) -> Tensor:
    """loss = −Σ_t sg(clip(r_t, clip_low, clip_high)) · log p(x_t) · A_t: the clipped ratio
    weighs the gradient of every token, none is dropped (MiniMax-M1's CISPO)."""
    clipped_T = (logp_T - sampling_logp_T).exp().clamp(clip_low, clip_high).detach()
    return -(clipped_T * logp_T * adv_T).sum()


def dro(logp_T: Tensor, sampling_logp_T: Tensor, adv_T: Tensor, beta: float) -> Tensor:
    """loss = −Σ_t (log p(x_t) · A_t − ½ β (log p(x_t) − log q(x_t))²): a quadratic penalty
    in place of a clip (Richemond et al. 2024)."""
    quadratic_T = (logp_T - sampling_logp_T) ** 2
    return -(logp_T * adv_T - 0.5 * beta * quadratic_T).sum()


def gspo(
    logp_T: Tensor,
    sampling_logp_T: Tensor,
    adv_T: Tensor,
    ratio_mask_T: Tensor,
    clip_low: float,
    clip_high: float,
) -> Tensor:
    """GSPO-token (Zheng et al. 2025, §4.2), the variant Tinker runs:
        s = exp(mean_{t∈M} (sg(log p_t) − log q_t)),   M = positions where ratio_mask ≠ 0
        s_t = sg(s) · p_t / sg(p_t)        (s's value, token t's own gradient)
        loss = −Σ_t min(s_t · A_t, clip(s_t, clip_low, clip_high) · A_t)
    The mean, never the sum, of the log-ratios: a sequence ratio near 1 at any length."""
    in_ratio_T = ratio_mask_T != 0
    log_ratio = (logp_T.detach() - sampling_logp_T)[in_ratio_T].mean()
    ratio_T = (log_ratio + logp_T - logp_T.detach()).exp()
    clipped_T = ratio_T.clamp(clip_low, clip_high)
    return -(ratio_T * adv_T).minimum(clipped_T * adv_T).sum()
