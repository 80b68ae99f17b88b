"""Pure RL algorithm functions: advantages, per-token log-probs, policy-gradient losses."""

from looprl.algo.advantages import (
    Advantage,
    batch_advantages,
    bonus_terms,
    dynamic_sampling_keep,
    episode_advantages,
    group_advantages,
    group_advantages_of,
    group_turn_advantages,
    moves,
    turn_returns,
)
from looprl.algo.cispo import cispo_loss
from looprl.algo.corrections import Correction, correct, correction_stats, masked_counts
from looprl.algo.distill import opd_loss
from looprl.algo.kl import k3_kl, kl_tokens
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
    LossFn,
    Normalizer,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from looprl.algo.selection import (
    choose_tasks,
    is_mastered,
    record_groups,
    refill_count,
    task_weights,
)
from looprl.algo.tis import tis_weights, weight_gradient
from looprl.algo.turns import gspo_turn_loss, turn_ids

# every policy loss by its `algo.name`; all take the same arguments (losses.py)
LOSSES: dict[str, LossFn] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "gspo_turn": gspo_turn_loss,
    "grpo": grpo_loss,
    "dr_grpo": dr_grpo_loss,
    "cispo": cispo_loss,
}

__all__ = [
    "LOSSES",
    "Correction",
    "cispo_loss",
    "correct",
    "correction_stats",
    "kl_tokens",
    "masked_counts",
    "opd_loss",
    "tis_weights",
    "weight_gradient",
    "Normalizer",
    "batch_advantages",
    "choose_tasks",
    "dr_grpo_loss",
    "dynamic_sampling_keep",
    "episode_advantages",
    "group_advantages_of",
    "group_advantages",
    "group_turn_advantages",
    "bonus_terms",
    "moves",
    "turn_returns",
    "Advantage",
    "head_logprobs",
    "is_mastered",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "gspo_turn_loss",
    "k3_kl",
    "masked_mean",
    "masked_sum",
    "record_groups",
    "refill_count",
    "scale_logits",
    "scoring_temperature",
    "task_weights",
    "tempered_log_softmax",
    "token_logprobs",
    "turn_ids",
]
