"""Optional SFT warm start on the environment's demonstrations.

Small models often cannot produce a valid tool call on their own, so RL has no signal
(every reward is −1). Environments may provide `demonstrations(task)`: expert assistant
messages. Each is written in the model's own call syntax, played through the
environment to get the exact token sequence an episode would have, and trained on with
next-token cross-entropy on the assistant tokens only (loss mask 1), token-mean.

With `sft.loss_on: free` and a forced call, the mean is over the tokens the call's
grammar leaves free only. Of the ≈ 20 tokens of `{"name": "choose_square", "arguments":
{"square": 5}}` one, the digit, is the decision; the rest are forced at sampling time
anyway, and their (quickly tiny) losses only dilute the mean of the one that matters
(which tokens are forced: loop/decisions.py).
"""

from __future__ import annotations

from typing import Any

import torch

from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.envs import Environment
from looprl.forward.score import is_sharded, micro_batches, sequence_logprobs
from looprl.loop.batches import scoring_keys
from looprl.loop.decisions import grammar_masked
from looprl.loop.dist import Dist
from looprl.loop.guidance import expert_episode
from looprl.loop.policy import Policy
from looprl.loop.shard import clip_gradients, synced_passes
from looprl.model.memory import release_free_memory
from looprl.types import Episode, Task


def demo_episode(
    env: Environment, task: Task, renderer: ChatRenderer, grammars: Any = None
) -> Episode:
    """The token sequence of `task` played with its demonstration messages
    (`expert_episode`). With `grammars` (an engine's GrammarCache), tokens a forced call's
    grammar leaves no choice about get loss mask 0 (`free_tokens`)."""
    episode = expert_episode(env, task, renderer)
    return episode if grammars is None else grammar_masked(episode, grammars, renderer.tokenizer)


def sft_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    episodes: list[Episode],
    cfg: Config,
    dist: Dist,
) -> dict[str, float]:
    """One optimizer step of −mean log p(assistant tokens), accumulated over micro-batches
    (each divided by the whole batch's token count, so the split does not matter).

    Every rank gets the same `episodes`. A sharded model (train.shard=fsdp) splits them:
    each rank its share, its micro-batches padded to the busiest rank's count, and FSDP2
    sums the ranks' gradients (loop/shard.py); otherwise each rank takes the same step."""
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    tokens = float(sum(e.response_len for e in episodes))
    sharded = is_sharded(policy.model)
    mine = dist.share(episodes) if sharded else episodes
    batches = list(micro_batches(*scoring_keys(mine), cfg.train.micro_batch_tokens))
    total = 0.0
    every = cfg.train.shard_grad_sync == "every"
    for indices in synced_passes(policy.model, batches, dist, every):
        chunk = [mine[i] for i in indices]
        logp_BS, mask_BS = sequence_logprobs(
            policy.model,
            [e.token_ids for e in chunk],
            [e.loss_mask for e in chunk],
            policy.tokenizer.pad_token_id or 0,
            policy.device,
            temperature=1.0,
        )
        loss = -(logp_BS * mask_BS).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    if sharded:
        total = dist.all_reduce([total])[0]
    norm = clip_gradients(policy.trainable_parameters(), cfg.train.max_grad_norm)
    if torch.isfinite(norm) and total == total:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_free_memory()  # the activations' freed pages, before the next phase
    return {"sft/loss": total, "sft/grad_norm": float(norm), "sft/tokens": tokens}
