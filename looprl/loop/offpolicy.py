"""How far the episodes' sampler is from the trainer, and what the update does about it.

- `samples_policy_exactly`: whether the engine's logprobs *are* the trainer's old ones
  (then no old-logprob pass is needed, loop/update.py);
- `gap_stats`: the engine-vs-trainer token-parity check (`rollout/logprob_gap`,
  `rollout/mismatch_kl`);
- `set_corrections`, `corrected`: `algo.is_correction`, the
  importance-sampling correction of each episode's tokens (algo/corrections.py) as the
  update applies it: weights on the gradient, and masked tokens out of both the loss and
  its normaliser.
"""

from __future__ import annotations

import numpy as np
import torch

from looprl.algo import Correction, correct, correction_stats, k3_kl, weight_gradient
from looprl.config import AlgoConfig
from looprl.engine.hf import HFEngine
from looprl.loop.batches import Scored
from looprl.loop.dist import Dist
from looprl.loop.policy import Policy
from looprl.model.load import base_model


def set_corrections(batch: list[Scored], algo: AlgoConfig, dist: Dist) -> dict[str, float]:
    """Each episode's correction, from its old logprobs (the trainer's, before the step)
    and its behaviour logprobs (the engine's); the masked and truncated shares over all
    ranks. Nothing (and no stats) without `algo.is_correction`."""
    if algo.is_correction is None or algo.is_bound is None:
        return {}
    scored = [s for s in batch if s.old is not None]
    for sample in scored:
        sample.correction = correct(sample.old, sample.behaviour, algo.is_correction, algo.is_bound)
    corrections = [s.correction for s in scored if s.correction is not None]
    stats = correction_stats(corrections)
    tokens = sum(c.keep_T.numel() for c in corrections)
    kept = sum(int(c.keep_T.sum()) for c in corrections)
    masked, truncated, weight, count, kept = dist.all_reduce([
        stats["is_masked_frac"] * tokens,
        stats["is_truncated_frac"] * tokens,
        stats["is_weight_mean"] * kept,
        tokens,
        kept,
    ])  # fmt: skip
    return {
        "is_masked_frac": masked / count if count else 0.0,
        "is_truncated_frac": truncated / count if count else 0.0,
        "is_weight_mean": weight / kept if kept else 1.0,
    }


def corrected(
    logp_BK: torch.Tensor, mask_BK: torch.Tensor, corrections: list[Correction | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's logprobs with each token's gradient weighted, and the loss mask
    without the masked tokens. Unchanged where the rows carry no correction."""
    if all(c is None for c in corrections):
        return logp_BK, mask_BK
    w_BK = torch.ones_like(logp_BK, dtype=torch.float32)
    keep_BK = torch.ones_like(mask_BK, dtype=torch.bool)
    for row, correction in enumerate(corrections):
        if correction is not None:
            w_BK[row][mask_BK[row]] = correction.weight_T.to(w_BK)
            keep_BK[row][mask_BK[row]] = correction.keep_T.to(keep_BK.device)
    return weight_gradient(logp_BK, w_BK), mask_BK & keep_BK


def samples_policy_exactly(policy: Policy) -> bool:
    """Whether the policy's engine samples from the policy module itself, in its own
    dtype and with no dropout: then the engine's logprobs of fresh episodes are the
    trainer's old logprobs, to float32 rounding."""
    engine = policy.engine
    if not isinstance(engine, HFEngine) or engine.policy_model is not policy.model:
        return False
    dtype = next(policy.model.parameters()).dtype
    if engine.sampler_dtype not in (None, dtype):
        return False
    return not has_dropout(policy.model)


def has_dropout(model: torch.nn.Module) -> bool:
    """Any dropout training mode turns on: a module's, or the attention's (config)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(base_model(model), "config", None)
    return bool(getattr(config, "attention_dropout", 0.0))


def gap_stats(checks: list[tuple[torch.Tensor, torch.Tensor]], dist: Dist) -> dict[str, float]:
    """The token-parity check on (trainer's, engine's) logprobs before any update:
    `logprob_gap`, their mean absolute difference per episode; `mismatch_kl`, the sampling
    policy's KL to the trainer's per token (k3 over the sampled tokens: the off-policy gap
    that overlapped rollouts add to the engine's numerics)."""
    gaps = [(trainer - engine).abs().mean().item() for trainer, engine in checks]
    gap_sum, gap_count = dist.all_reduce([float(np.sum(gaps)), len(gaps)])
    kls = [k3_kl(engine, trainer) for trainer, engine in checks]
    kl_sum, kl_count = dist.all_reduce(
        [float(sum(k.sum().item() for k in kls)), sum(k.numel() for k in kls)]
    )
    return {
        "logprob_gap": gap_sum / gap_count if gap_count else float("nan"),
        "mismatch_kl": kl_sum / kl_count if kl_count else float("nan"),
    }
