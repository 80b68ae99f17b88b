"""Clipped policy-gradient losses: GSPO, GSPO-token, GRPO (DAPO token-mean), Dr.GRPO.

Every loss is called the same way

    loss, stats = fn(logp_BT, old_logp_BT, adv_B, mask_BT, *, eps_low, eps_high,
                     ref_logp_BT=None, kl_coef=0.0, normalizer=None)

and returns a 0-dim loss to minimise and a dict of python floats, so a trainer picks one
from `looprl.algo.LOSSES` by name and never needs to know which. Inputs:

    logp_BT      log pi_theta(y_t) of the current policy, with grad        [B, T]
    old_logp_BT  log pi_old(y_t) of the policy that sampled (no grad)      [B, T]
    adv_B        one advantage per sequence (see advantages.py)            [B]
    mask_BT      1 on policy-generated tokens, 0 on prompt/tool/padding    [B, T]
    ref_logp_BT  log pi_ref(y_t) of the frozen reference, for the KL term  [B, T]
    normalizer   the counts a loss divides by (`Normalizer`), see below

Clipped surrogate (PPO, arXiv 1707.06347) with an asymmetric range (DAPO "clip-higher",
arXiv 2503.14476):

    obj = min(w * A, clip(w, 1 - eps_low, 1 + eps_high) * A)

where w is a sequence ratio (GSPO) or a token ratio (GRPO, Dr.GRPO). Log-ratios are clamped
to [-20, 20] before exp so a diverged policy gives a huge but finite ratio, not inf/NaN.
Masked positions are removed with `torch.where` before anything else, so whatever values
sit there (padding, -inf) never reach the loss and get exactly zero gradient.

Micro-batching and `normalizer`
-------------------------------
Each loss is a SUM of per-unit terms divided by its own normaliser, which it reads from
the `Normalizer` it is given (N_seq sequences, N_tok masked tokens, L_max = max_tokens):

    gspo, gspo_token:  loss = sum_i term_i / N_seq
    grpo (token mean): loss = sum_{i,t} term_it / N_tok
    dr_grpo:           loss = sum_i (sum_t term_it / L_max) / N_seq,  L_max a constant

By default (normalizer=None) every count comes from this call: N_seq = B,
N_tok = sum(mask), L_max = T. To split a minibatch into micro-batches and accumulate
gradients, pass the *whole minibatch's* counts to every call:

    n = Normalizer.of(mask_minibatch, max_tokens=L_max)
    loss(minibatch) == sum_k loss(micro_k, normalizer=n)      (value and gradient)

so call backward() on each micro-batch loss as is, with no extra scaling. The KL term
obeys the same convention (see `kl.kl_term`). A sequence whose mask is all 0 contributes
nothing but still counts in N_seq: drop such rows before the call, or pass the counts.

Stats (python floats, for *this call* only; `count` lets the trainer weight them when
averaging over micro-batches):

    clip_frac   fraction of units whose ratio was clipped AND the clipped branch won the
                min, i.e. the units whose policy-gradient is zeroed by clipping:
                (A > 0 and w > 1 + eps_high) or (A < 0 and w < 1 - eps_low).
                Units are sequences for gspo/gspo_token, masked tokens for grpo/dr_grpo.
                A ratio outside the range whose unclipped branch is the min (the
                pessimistic side) is not counted: its gradient still flows.
    ratio_mean, ratio_min, ratio_max   over the same units (1.0 when there are none)
    count       number of units (sequences with >= 1 masked token, or masked tokens)
    pg_loss     the policy-gradient part of the loss, before kl
    kl          mean k3 KL to the reference (only when ref_logp_BT is given)

The parts the losses share (shape check, log-ratios, the clipped objective, the KL term
and these stats) are in `loss_parts.py`; turn-level GSPO (`turns.py`) uses them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO
from looprl.algo.logprobs import masked_mean, masked_sum
from looprl.algo.loss_parts import (
    _check_shapes,
    _clipped_objective,
    _finish,
    _masked_log_ratio,
    _sequence_log_ratio,
)

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


@dataclass(frozen=True)
class Normalizer:
    """The counts a loss may divide its sum by; each loss uses its own (module doc).

    Counted over the whole minibatch when it is split into micro-batches, so that the
    micro-batch losses add up to the minibatch loss.
    """

    sequences: float | Tensor  # N_seq: sequences (empty rows included)
    tokens: float | Tensor  # N_tok: loss-masked tokens
    max_tokens: float  # L_max: Dr.GRPO's constant length, e.g. the generation budget

    @classmethod
    def of(cls, mask_BT: Tensor, max_tokens: float | None = None) -> Normalizer:
        """Counts of one call: N_seq = B, N_tok = max(sum(mask), 1), L_max = max_tokens or T."""
        tokens = mask_BT.bool().sum().clamp(min=1)
        return cls(
            sequences=float(mask_BT.shape[0]),
            tokens=tokens,
            max_tokens=float(mask_BT.shape[-1]) if max_tokens is None else max_tokens,
        )


# ----------------------------------------------------------------------------- losses


def gspo_loss(
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
    """GSPO, Group Sequence Policy Optimization (arXiv 2507.18071), sequence-level ratio.

    s_i  = exp( sum_t m_it (logp_it - old_it) / sum_t m_it )      (exp of the mean)
    L    = - sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) / N,   N = #sequences
    Default eps 3e-4 / 4e-4 as in the paper (sequence ratios stay very close to 1).
    A row with an all-zero mask contributes 0 (and no NaN). clip_frac is over sequences.
    """
    _check_shapes(logp_BT, old_logp_BT, adv_B, mask_BT)
    m_BT = mask_BT.bool()
    valid_B = m_BT.any(dim=-1)
    n = (normalizer or Normalizer.of(mask_BT)).sequences  # N_seq
    adv_B = adv_B.detach().to(logp_BT.dtype)

    s_B = torch.exp(_sequence_log_ratio(logp_BT, old_logp_BT, m_BT))
    obj_B, clip_active_B = _clipped_objective(s_B, adv_B, eps_low, eps_high)
    obj_B = torch.where(valid_B, obj_B, torch.zeros_like(obj_B))
    pg_loss = -obj_B.sum() / n  # -(1/N) sum_i min(s_i A_i, clip(s_i) A_i)

    return _finish(
        pg_loss,
        logp_BT,
        ref_logp_BT,
        m_BT,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        normalizer=n,
        per_sequence=True,
        ratio_U=s_B[valid_B],
        clip_active_U=clip_active_B[valid_B],
    )


def gspo_token_loss(
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
    """GSPO-token (arXiv 2507.18071, sec. 4.3): sequence ratio value, per-token gradient path.

    s_it = sg[s_i] * exp(logp_it - sg[logp_it])        (value s_i, d s_it/d logp_it = s_i)
    L    = - sum_i (1/|y_i|) sum_t m_it min(s_it A_i, clip(s_it) A_i) / N,   N = #sequences

    With one advantage per sequence (adv_B) this equals `gspo_loss` exactly, in value and in
    gradient: both give dL/dlogp_it = -A_i s_i m_it / (|y_i| N) when the clip is inactive,
    and 0 when it is active. It only differs once advantages vary per token, which this
    signature does not take; it is kept as the hook for that. Stats are per sequence.
    """
    _check_shapes(logp_BT, old_logp_BT, adv_B, mask_BT)
    m_BT = mask_BT.bool()
    valid_B = m_BT.any(dim=-1)
    n = (normalizer or Normalizer.of(mask_BT)).sequences  # N_seq
    adv_B = adv_B.detach().to(logp_BT.dtype)

    s_B = torch.exp(_sequence_log_ratio(logp_BT, old_logp_BT, m_BT)).detach()  # sg[s_i]
    lp_BT = torch.where(m_BT, logp_BT, torch.zeros_like(logp_BT))
    s_BT = s_B[:, None] * torch.exp(lp_BT - lp_BT.detach())  # sg[s_i] exp(logp - sg[logp])
    obj_BT, _ = _clipped_objective(s_BT, adv_B[:, None], eps_low, eps_high)
    _, clip_active_B = _clipped_objective(s_B, adv_B, eps_low, eps_high)
    # (1/|y_i|) sum_t m_it obj_it, 0 for an empty row
    obj_B = masked_mean(obj_BT, m_BT, dim=-1)
    pg_loss = -obj_B.sum() / n

    return _finish(
        pg_loss,
        logp_BT,
        ref_logp_BT,
        m_BT,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        normalizer=n,
        per_sequence=True,
        ratio_U=s_B[valid_B],
        clip_active_U=clip_active_B[valid_B],
    )


def _token_ratio_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    ref_logp_BT: Tensor | None,
    kl_coef: float,
    normalizer: Normalizer | None,
    token_mean: bool,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """Token ratios r_it = exp(logp_it - old_it), clipped per token; GRPO and Dr.GRPO
    differ only in how the sum over tokens is normalised (`token_mean`, see callers)."""
    _check_shapes(logp_BT, old_logp_BT, adv_B, mask_BT)
    m_BT = mask_BT.bool()
    norm = normalizer or Normalizer.of(mask_BT)
    adv_B = adv_B.detach().to(logp_BT.dtype)

    log_r_BT = _masked_log_ratio(logp_BT, old_logp_BT, m_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r_BT = torch.exp(log_r_BT)
    obj_BT, clip_active_BT = _clipped_objective(r_BT, adv_B[:, None], eps_low, eps_high)
    if token_mean:
        n = norm.tokens
        pg_loss = -masked_sum(obj_BT, m_BT) / n  # -sum_{i,t} m_it obj_it / N_tok
    else:
        if norm.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {norm.max_tokens}")
        n = norm.sequences
        pg_loss = -masked_sum(obj_BT, m_BT) / norm.max_tokens / n  # -sum_i (sum_t / L_max) / N_seq

    return _finish(
        pg_loss,
        logp_BT,
        ref_logp_BT,
        m_BT,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        normalizer=n,
        per_sequence=not token_mean,
        ratio_U=r_BT[m_BT],
        clip_active_U=clip_active_BT[m_BT],
    )


def grpo_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: Normalizer | None = None,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """GRPO with DAPO's token-level loss and clip-higher (arXiv 2503.14476).

    r_it = exp(logp_it - old_it)
    L    = - sum_{i,t} m_it min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) / N_tok,
    N_tok = number of masked tokens (in the whole minibatch when micro-batching).
    Every token weighs the same, so long sequences are not down-weighted (DAPO sec. 3.3).
    The KL term is a token mean as well. clip_frac is over masked tokens.
    """
    return _token_ratio_loss(
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        eps_low=eps_low,
        eps_high=eps_high,
        ref_logp_BT=ref_logp_BT,
        kl_coef=kl_coef,
        normalizer=normalizer,
        kl_estimator=kl_estimator,
        token_mean=True,
    )


def dr_grpo_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: Normalizer | None = None,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """Dr.GRPO (arXiv 2503.20783): the token ratios of `grpo_loss`, a constant length.

    r_it = exp(logp_it - old_it)
    L    = - sum_i [ sum_t m_it min(r_it A_i, clip(r_it) A_i) / L_max ] / N_seq,
    L_max = `normalizer.max_tokens`, N_seq = number of sequences. Dividing by a constant
    (e.g. the generation budget) instead of |y_i| removes GRPO's length bias (long wrong
    answers penalised less per token); it must be the same for every micro-batch. The KL
    term is a per-sequence mean. Clip defaults follow grpo_loss (clip-higher); clip_frac
    is per token.
    """
    return _token_ratio_loss(
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        eps_low=eps_low,
        eps_high=eps_high,
        ref_logp_BT=ref_logp_BT,
        kl_coef=kl_coef,
        normalizer=normalizer,
        kl_estimator=kl_estimator,
        token_mean=False,
    )
