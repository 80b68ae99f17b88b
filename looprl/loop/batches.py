"""How the update cuts a rollout batch: `minibatches` of whole tasks (one optimizer step
each), the per-episode inputs of forward/score.py's `micro_batches` (one forward pass
each, under a token budget), and that budget, which running out of memory halves
(`retry_on_oom`; carried across steps and a resume in `UpdateState`); and `Scored`, one
episode as the update scores it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from looprl.algo import Advantage, Correction, scoring_temperature
from looprl.errors import LoopRLError
from looprl.forward.score import prompt_length
from looprl.loop.dist import Dist
from looprl.types import Episode

log = logging.getLogger("looprl")
T = TypeVar("T")
MIN_MICRO_BATCH_TOKENS = 64


@dataclass
class UpdateState:
    """What the update carries from step to step (and across a resume)."""

    micro_batch_tokens: int
    oom_retries: int = 0


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def retry_on_oom(fn: Callable[[int], T], state: UpdateState, optimizer: torch.optim.Optimizer) -> T:
    """Run fn(micro_batch_tokens); on out-of-memory halve the budget and run it again."""
    while True:
        try:
            return fn(state.micro_batch_tokens)
        except BaseException as err:
            if not is_out_of_memory(err):
                raise
            optimizer.zero_grad(set_to_none=True)
            half = state.micro_batch_tokens // 2
            if half < MIN_MICRO_BATCH_TOKENS:
                raise LoopRLError(
                    "out of memory even with micro-batches of "
                    f"{state.micro_batch_tokens} tokens; use a smaller model, LoRA "
                    "(model.lora.enabled=true), model.gradient_checkpointing=true, or "
                    "shorter episodes (rollout.max_new_tokens)"
                ) from err
            log.warning("out of memory: micro-batch budget %d -> %d tokens", half * 2, half)
            state.micro_batch_tokens = half
            state.oom_retries += 1


def minibatches(
    units: list[list[T]], count: int, seed: int, dist: Dist | None = None
) -> list[list[T]]:
    """Shuffle whole units (a task's members, `task_units`) into `count` minibatches, so
    that a group's episodes share one prompt pass (see sequence_logprobs).

    Over several processes the shuffle is of all ranks' units, in rank order (the order
    of one process's batch), and each rank keeps its own units of every minibatch: every
    rank returns the same number of minibatches, some possibly empty on some ranks."""
    dist = dist or Dist()
    counts = [int(n) for n in dist.gather([len(units)])]
    first = sum(counts[: dist.rank])
    total = sum(counts)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    splits = [split for split in torch.tensor_split(order, min(count, total)) if len(split)]
    return [
        [
            item
            for i in split.tolist()
            if first <= i < first + len(units)
            for item in units[i - first]
        ]
        for split in splits
    ]


def scoring_keys(
    episodes: Sequence[Episode], whole: bool = False
) -> tuple[list[list[int]], list[int], list[float]]:
    """What forward/score.py's `micro_batches` splits episodes on: their token ids, prompt
    lengths and scoring temperatures (greedy episodes are scored at 1, as those sampled at
    1, so they share a micro-batch). `micro_batches(*scoring_keys(episodes), budget)`.
    `whole`: the passes run whole sequences (a sharded model, loop/shard.py), so no
    prompt is counted once for several episodes."""
    return (
        [e.token_ids for e in episodes],
        [0 if whole else prompt_length(e.loss_mask) for e in episodes],
        [scoring_temperature(e.temperature) for e in episodes],
    )


@dataclass(eq=False)
class Scored:
    """One episode as the update scores it: its advantage and, once computed, the
    trainer's logprobs of its generated tokens before the step (`old`) and the reference
    policy's (`ref`, with `algo.kl_coef`), in order."""

    episode: Episode
    advantage: Advantage
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    correction: Correction | None = None  # algo.is_correction's, once `old` is known
    teacher: torch.Tensor | None = None  # algo.teacher's logprobs (on-policy distillation)

    @property
    def sampled(self) -> torch.Tensor:
        """The engine's logprobs of the episode's generated tokens, in order."""
        e = self.episode
        return torch.tensor([lp for lp, m in zip(e.logprobs, e.loss_mask) if m])

    @property
    def behaviour(self) -> torch.Tensor:
        """The logprobs of the policy that produced the episode. An expert episode was not
        sampled: the policy before the step stands in for it (loop/guidance.py)."""
        assert self.old is not None
        return self.old if self.episode.expert else self.sampled
