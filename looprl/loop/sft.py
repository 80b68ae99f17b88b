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
from looprl.engine.requests import generation_request
from looprl.envs import demonstrations
from looprl.errors import EnvError
from looprl.loop.decisions import free_tokens
from looprl.loop.policy import Policy, sequence_logprobs
from looprl.loop.update import micro_batches
from looprl.types import Episode, Task


def demo_episode(env: Any, task: Task, renderer: ChatRenderer, grammars: Any = None) -> Episode:
    """The token sequence of `task` played with its demonstration messages. With
    `grammars` (an engine's GrammarCache), tokens a forced call's grammar leaves no
    choice about get loss mask 0 (`free_tokens`)."""
    demos = demonstrations(env, task)
    if not demos:
        raise EnvError(
            f"environment {type(env).__name__} has no demonstrations for task {task.id}; "
            "sft.enabled needs an environment with a demonstrations(task) method"
        )
    obs = env.reset(task)
    history = list(obs.messages)
    ids = renderer.prompt_ids(history, obs.tools)
    episode = Episode(task=task, messages=history, token_ids=ids, loss_mask=[0] * len(ids),
                      logprobs=[0.0] * len(ids))  # fmt: skip
    constraint = generation_request([], obs.tools, obs.tool_choice, renderer.format).constraint
    for demo in demos:
        completion = renderer.assistant_ids(demo)
        episode.token_ids += completion
        if grammars is not None and constraint is not None:
            matcher = grammars.matcher(constraint)
            episode.loss_mask += free_tokens(
                matcher, completion, renderer.tokenizer, grammars.info.vocab_size
            )
        else:
            episode.loss_mask += [1] * len(completion)
        episode.logprobs += [0.0] * len(completion)
        history.append(demo)
        result = env.step(demo)
        episode.reward, episode.outcome = result.reward, result.outcome or ""
        if result.done:
            break
        more = renderer.continuation_ids(history, result.messages, obs.tools, completion)
        history.extend(result.messages)
        episode.token_ids += more
        episode.loss_mask += [0] * len(more)
        episode.logprobs += [0.0] * len(more)
    return episode


def sft_step(
    policy: Policy, optimizer: torch.optim.Optimizer, episodes: list[Episode], cfg: Config
) -> dict[str, float]:
    """One optimizer step of −mean log p(assistant tokens), accumulated over micro-batches
    (each divided by the whole batch's token count, so the split does not matter)."""
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    tokens = float(sum(e.response_len for e in episodes))
    total = 0.0
    for chunk in micro_batches(episodes, cfg.train.micro_batch_tokens):
        logp_BS, mask_BS = sequence_logprobs(
            policy.model, [e.token_ids for e in chunk], [e.loss_mask for e in chunk],
            policy.tokenizer.pad_token_id or 0, policy.device, temperature=1.0,
        )  # fmt: skip
        loss = -(logp_BS * mask_BS).sum() / tokens
        loss.backward()
        total += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.train.max_grad_norm)
    if torch.isfinite(norm) and total == total:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"sft/loss": total, "sft/grad_norm": float(norm), "sft/tokens": tokens}
