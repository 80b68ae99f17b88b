"""Pure RL algorithm functions: advantages, per-token log-probs, policy-gradient losses."""

from looprl.algo.advantages import (
    batch_advantages,
    dynamic_sampling_keep,
    episode_advantages,
    group_advantages,
)
from looprl.algo.kl import k3_kl
from looprl.algo.logprobs import (
    head_logprobs,
    masked_mean,
    masked_sum,
    scale_logits,
    scoring_temperature,
    tempered_log_softmax,
    token_logprobs,
)
from looprl.algo.losses import (
    LOSSES,
    Normalizer,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from looprl.algo.tis import tis_weights, weight_gradient

__all__ = [
    "LOSSES",
    "tis_weights",
    "weight_gradient",
    "Normalizer",
    "batch_advantages",
    "dr_grpo_loss",
    "dynamic_sampling_keep",
    "episode_advantages",
    "group_advantages",
    "head_logprobs",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "k3_kl",
    "masked_mean",
    "masked_sum",
    "scale_logits",
    "scoring_temperature",
    "tempered_log_softmax",
    "token_logprobs",
]
