"""The parts every policy loss of `losses.py` and `turns.py` is built from: the shape
check, the masked log-ratios (per token, and GSPO's length-normalised per sequence), the
clipped objective, the KL term added and the stats of one call."""

from __future__ import annotations

import torch
from torch import Tensor

from looprl.algo.kl import MAX_LOG_RATIO, kl_term


def _check_shapes(logp_BT: Tensor, old_logp_BT: Tensor, adv_B: Tensor, mask_BT: Tensor) -> None:
    if logp_BT.dim() != 2:
        raise ValueError(f"logp_BT must be [B, T], got {tuple(logp_BT.shape)}")
    if old_logp_BT.shape != logp_BT.shape or mask_BT.shape != logp_BT.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp_BT.shape)}, old_logp "
            f"{tuple(old_logp_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    if adv_B.shape != logp_BT.shape[:1]:
        raise ValueError(f"adv_B must be [B]={logp_BT.shape[0]}, got {tuple(adv_B.shape)}")


def _masked_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    # log w_it = logp_it - old_it on masked tokens, exactly 0 (no grad) elsewhere
    diff_BT = logp_BT - old_logp_BT.detach()
    return torch.where(m_BT, diff_BT, torch.zeros_like(diff_BT))


def _clipped_objective(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """obj = min(w A, clip(w, 1-eps_low, 1+eps_high) A) and where the clip zeroed the grad."""
    unclipped = ratio * adv  # w A
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # clip(w) A
    obj = torch.minimum(unclipped, clipped)
    # the clipped branch is active (grad 0) iff w left the range on the side A pushes it to
    clip_active = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return obj, clip_active


def _stats(
    ratio_U: Tensor, clip_active_U: Tensor, pg_loss: Tensor, kl: Tensor | None
) -> dict[str, float]:
    """Stats over the units U (valid sequences or masked tokens), one device sync."""
    with torch.no_grad():
        count = ratio_U.numel()
        dtype = pg_loss.dtype
        if count:
            r_U = ratio_U.detach()
            vals = [clip_active_U.to(dtype).mean(), r_U.mean(), r_U.min(), r_U.max()]
        else:
            one = pg_loss.new_ones(())
            vals = [one * 0.0, one, one, one]
        vals.append(pg_loss.detach())
        if kl is not None:
            vals.append(kl.detach())
        floats = torch.stack([v.to(dtype) for v in vals]).tolist()
    stats = {
        "clip_frac": floats[0],
        "ratio_mean": floats[1],
        "ratio_min": floats[2],
        "ratio_max": floats[3],
        "count": float(count),
        "pg_loss": floats[4],
    }
    if kl is not None:
        stats["kl"] = floats[5]
    return stats


def _finish(
    pg_loss: Tensor,
    logp_BT: Tensor,
    ref_logp_BT: Tensor | None,
    m_BT: Tensor,
    *,
    kl_coef: float,
    normalizer: float | Tensor,
    per_sequence: bool,
    ratio_U: Tensor,
    clip_active_U: Tensor,
    kl_estimator: str = "k3",
) -> tuple[Tensor, dict[str, float]]:
    loss = pg_loss
    kl_stat = None
    if ref_logp_BT is not None:
        kl_loss, kl_stat = kl_term(
            logp_BT, ref_logp_BT, m_BT, normalizer, per_sequence, kl_estimator
        )
        if kl_coef > 0:
            loss = loss + kl_coef * kl_loss  # L = L_pg + beta * KL
    stats = _stats(ratio_U, clip_active_U, pg_loss, kl_stat)
    return loss, stats


def _sequence_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, m_BT: Tensor) -> Tensor:
    # log s_i = sum_t m_it (logp_it - old_it) / max(sum_t m_it, 1)   -- the MEAN, not the sum
    # (GSPO eq. 7: s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|), length-normalised)
    len_B = m_BT.sum(dim=-1).clamp(min=1).to(logp_BT.dtype)
    log_s_B = _masked_log_ratio(logp_BT, old_logp_BT, m_BT).sum(dim=-1) / len_B
    return log_s_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
