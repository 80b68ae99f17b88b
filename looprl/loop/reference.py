"""The KL penalty's reference policy (`algo.kl_reference`).

- `base`: the base model, the LoRA adapters switched off (`model.disable_adapter()`).
- `start`: the policy as the RL steps began, i.e. after the SFT warm start when there is
  one: an anchor to what the warm start taught rather than to the base model. Its trainable
  weights (the adapters) are kept in memory and swapped in for the reference pass, and
  written once to `RUN/checkpoints/rl_start` (loadable wherever a checkpoint is; each
  rank its shards under `train.shard_checkpoint: sharded`, as the step checkpoints), from
  which a resumed run takes them back, in either layout. With train.shard=fsdp each rank
  keeps its shard of them; the reference pass runs on whole weights (loop/shard.py
  `full_weights`), so each is gathered whole as it is swapped in, every rank together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from looprl.config import Config
from looprl.errors import LoopRLError
from looprl.forward.score import is_sharded
from looprl.loop.checkpoint import (
    checkpoint_weights,
    has_weights,
    place,
    save_weights,
    trainable_state,
    writes_shards,
)
from looprl.loop.checkpoint_sharded import is_sharded_checkpoint, read_sharded_like
from looprl.loop.dist import Dist
from looprl.loop.policy import Policy

START = "rl_start"  # the folder under RUN/checkpoints


def keep_reference(cfg: Config, policy: Policy, run_dir: Path, dist: Dist, start: int) -> None:
    """With `algo.kl_reference: start`, set `policy.reference` to the trainable weights the
    RL steps start from: now's (step 0: after the warm start, or a resume before the first
    step), written to RUN/checkpoints/rl_start; a run resumed past step 0 reads them back."""
    if cfg.algo.kl_coef == 0 or cfg.algo.kl_reference != "start":
        return
    folder = run_dir / "checkpoints" / START
    sharded = is_sharded(policy.model)
    params = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    if start > 0:  # resumed past the start: the weights it wrote then, in either layout
        if has_weights(folder):
            policy.reference = read_reference(folder, params)
            return
        raise LoopRLError(
            f"algo.kl_reference=start: this run resumes at step {start}, and the weights its "
            f"RL steps started from ({folder}) are missing; run again without --resume, or "
            "set algo.kl_reference=base"
        )
    if sharded:  # each rank its own shards
        policy.reference = {name: p.detach().clone() for name, p in params.items()}
    else:
        policy.reference = {k: v.clone() for k, v in trainable_state(policy.model).items()}
    save_weights(folder, policy.model, {"stage": START}, writes_shards(cfg.train))  # every rank


def read_reference(folder: Path, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """RUN/checkpoints/rl_start's weights laid out as `params`: a sharded model's ranks
    each read their own shards of a sharded folder (every rank calls it), or keep their
    shards of the whole tensors; an unsharded model reads them whole."""
    if is_sharded_checkpoint(folder) and any(isinstance(p, DTensor) for p in params.values()):
        return read_sharded_like(folder, params)
    return {
        name: place(tensor, params[name]) for name, tensor in checkpoint_weights(folder).items()
    }


@contextmanager
def reference_weights(policy: Policy) -> Iterator[Any]:
    """The model as the reference policy, for one pass without gradients: the base model
    (adapters off), or the RL start's weights swapped in and back (module doc)."""
    model = policy.model
    if policy.reference is None:
        with model.disable_adapter():
            yield model
        return
    params = dict(model.named_parameters())
    current = {name: params[name].detach().clone() for name in policy.reference}
    try:
        with torch.no_grad():
            for name, tensor in policy.reference.items():
                if isinstance(tensor, DTensor):  # a shard: whole weights are in the model now
                    tensor = tensor.full_tensor()
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
        yield model
    finally:
        with torch.no_grad():
            for name, tensor in current.items():
                params[name].copy_(tensor)
