"""Truncated importance sampling (TIS) for rollouts sampled by another engine.

When the sampler (vLLM, or a bf16 copy) and the trainer compute slightly different
distributions, the rollouts are off-policy with respect to the trainer's old policy.
TIS (as TRL and verl apply it; Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training", 2025) corrects each token's policy gradient by the ratio
of the two, truncated from above so that a rare large ratio cannot blow up the step:

    w_t = min( exp(logp_trainer_old_t - logp_engine_t), cap )       (no gradient)

and the loss of token t is weighted by w_t. `weight_gradient` applies it without
touching the losses: the loss keeps its value (and its clipping sees the true ratio),
while d loss / d logp_t is multiplied by w_t, which is what weighting token t's loss
term does to the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tis_weights(old_logp_BT: Tensor, engine_logp_BT: Tensor, mask_BT: Tensor, cap: float) -> Tensor:
    """w_BT = min(exp(old - engine), cap) on masked tokens, 1 elsewhere (no grad)."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    log_w_BT = (old_logp_BT - engine_logp_BT).detach().float()
    w_BT = torch.exp(log_w_BT.clamp(max=torch.log(torch.tensor(float(cap))).item()))
    return torch.where(mask_BT.bool(), w_BT, torch.ones_like(w_BT)).to(old_logp_BT.dtype)


def weight_gradient(logp_BT: Tensor, w_BT: Tensor) -> Tensor:
    """The same values as logp_BT; the gradient reaching logp_t is scaled by w_t.

    out = w * logp + sg[(1 - w) * logp]   →   out == logp,  d out / d logp = w
    """
    w_BT = w_BT.detach().to(logp_BT.dtype)
    return w_BT * logp_BT + ((1.0 - w_BT) * logp_BT).detach()
