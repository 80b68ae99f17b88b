"""Importance-sampling corrections for episodes the trainer did not sample itself
(`algo.is_correction`): a vLLM or bf16 sampler, overlapped rollouts (`rollout.max_staleness`).

The engine that sampled an episode (`engine_logp`) and the trainer's policy before the
step (`old_logp`) give slightly different probabilities to the same tokens. Per token

    rho_t = exp(old_t - engine_t)                    the token's ratio
    rho_i = exp(sum_t (old_it - engine_it))          the sequence's ratio (their product)

and each mode turns them into a weight w on the token's policy gradient (no gradient
through w; applied with `tis.weight_gradient`) and a keep flag:

    token_truncate      w_t = min(rho_t, C)                   every token kept (TIS; `tis_cap`)
    token_mask          w_t = rho_t, kept iff rho_t <= C
    sequence_truncate   w_t = min(rho_i, C)                   every token kept
    sequence_mask       w_t = rho_i, kept iff rho_i <= C      the whole sequence or none
    icepop              w_t = rho_t, kept iff 1/B <= rho_t <= B  (two-sided band, IcePop,
                                                              arXiv 2510.18855)

A token that is not kept leaves the loss *and its denominator*: the loss is taken over
the kept tokens only and the normaliser counts only them (`masked_counts`), so masking
does not shrink the remaining tokens' gradient (the bug slime fixed in its PR #657).

C and B are `algo.is_bound` (its defaults are in config/algo.py). Log-ratios are
clamped to +-20 before exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop")


@dataclass(frozen=True)
class Correction:
    """One episode's correction over its generated tokens, in order."""

    weight_T: Tensor  # w_t, float32, no grad
    keep_T: Tensor  # bool: the token stays in the loss (and its denominator)
    truncated_T: Tensor  # bool: the weight was cut to the bound (truncate modes)


def correct(old_logp_T: Tensor, engine_logp_T: Tensor, mode: str, bound: float) -> Correction:
    """The weights and keep flags of one episode's T generated tokens (module doc)."""
    if mode not in MODES:
        raise ValueError(f"unknown importance-sampling correction {mode!r}: one of {MODES}")
    if bound <= 0 or (mode == "icepop" and bound < 1):
        raise ValueError(f"{mode}'s bound must be > 0 (>= 1 for icepop), got {bound}")
    if old_logp_T.shape != engine_logp_T.shape:
        raise ValueError(
            f"old and engine logprobs differ in length: {tuple(old_logp_T.shape)} against "
            f"{tuple(engine_logp_T.shape)}"
        )
    log_rho_T = (old_logp_T.detach().float() - engine_logp_T.detach().float()).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO
    )
    if mode.startswith("sequence"):
        log_rho_i = log_rho_T.sum().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        log_rho_T = log_rho_i.expand_as(log_rho_T)
    rho_T = torch.exp(log_rho_T)
    every_T = torch.ones_like(rho_T, dtype=torch.bool)
    if mode.endswith("truncate"):
        return Correction(rho_T.clamp(max=bound), every_T, rho_T > bound)
    none_T = torch.zeros_like(every_T)
    if mode == "icepop":
        return Correction(rho_T, (rho_T >= 1.0 / bound) & (rho_T <= bound), none_T)
    return Correction(rho_T, rho_T <= bound, none_T)  # token_mask, sequence_mask


def correction_stats(corrections: list[Correction]) -> dict[str, float]:
    """Over the tokens of the episodes given: `is_masked_frac`, the share left out of the
    loss; `is_truncated_frac`, the share whose weight was cut to the bound;
    `is_weight_mean`, the kept tokens' mean weight (0, 0 and 1 when there are none)."""
    keep_N = torch.cat([c.keep_T for c in corrections]) if corrections else torch.ones(0)
    if not keep_N.numel():
        return {"is_masked_frac": 0.0, "is_truncated_frac": 0.0, "is_weight_mean": 1.0}
    weight_N = torch.cat([c.weight_T for c in corrections])
    truncated_N = torch.cat([c.truncated_T for c in corrections])
    kept_N = weight_N[keep_N.bool()]
    return {
        "is_masked_frac": float((~keep_N.bool()).float().mean()),
        "is_truncated_frac": float(truncated_N.float().mean()),
        "is_weight_mean": float(kept_N.mean()) if kept_N.numel() else 1.0,
    }


def masked_counts(corrections: list[Correction | None]) -> tuple[int, int]:
    """(sequences, tokens) the masks remove from a minibatch's normaliser: a sequence
    leaves it when none of its tokens is kept."""
    sequences = sum(1 for c in corrections if c is not None and not bool(c.keep_T.any()))
    tokens = sum(int((~c.keep_T).sum()) for c in corrections if c is not None)
    return sequences, tokens
