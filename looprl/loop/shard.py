"""`train.shard: fsdp`: the policy's weights, gradients and optimizer state split over the
ranks with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), the one place that
knows how.

Each decoder layer is one FSDP unit and the root module (embeddings, final norm, output
head, through the PEFT wrapper) another: a rank keeps 1/N of every parameter, and a unit's
whole weights exist only while it runs (an all-gather before its forward and again before
its backward, a reduce-scatter of its gradients after). The optimizer steps on the shards.

Every forward pass of a sharded unit is a collective, so ranks must run the same number
of them. Two kinds of phase keep that true:

- Phases without gradients (rollouts, evals, old logprobs) run between `full_weights`'s
  one unshard and one reshard: the whole weights are gathered once, and forward passes
  then need no collective, so a rank plays and scores its own share at its own pace.
  With the vllm engine a rollout phase first pushes the weights to the server, each
  tensor gathered in turn (`rollout_weights`), and needs whole weights only to rescore
  forced calls with the policy.
- A minibatch's gradient runs `synced_passes`: every rank as many micro-batches as the
  rank with the most, padded with passes of weight zero (one token, loss x 0), and the
  gradients reduced on the last one only (`set_requires_gradient_sync`; on each with
  `train.shard_grad_sync: every`). The reduction sums (divide factor 1): each rank's
  loss is already divided by the whole minibatch's normaliser (loop/update.py), as the
  unsharded path's explicit all-reduce assumes. A pass scores with the body and the
  output head apart, the head at the loss positions only, inside one forward of the
  root unit (forward/score.py `root_call`): no [tokens, vocab] logits.

With one process there is nothing to split: `train.shard: fsdp` is accepted and the
model stays whole, so one config resumes at any world size (checkpoints hold whole
tensors, loop/checkpoint.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

from looprl.config import TrainConfig
from looprl.errors import ConfigError
from looprl.forward.score import decoder_and_head, is_sharded
from looprl.loop.dist import Dist, current
from looprl.model.load import base_model
from looprl.model.memory import fix_mmap_threshold, release_free_memory

T = TypeVar("T")


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The model's decoder layers, found generically: the `layers` ModuleList of the
    transformers model (through a PEFT wrapper), or the one ModuleList named `layers`."""
    base = base_model(model)
    body = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(body, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return layers
    found = [m for name, m in base.named_modules() if name.split(".")[-1] == "layers"]
    found = [m for m in found if isinstance(m, torch.nn.ModuleList) and len(m)]
    if len(found) != 1:
        raise ConfigError(
            f"train.shard=fsdp: no single list of decoder layers in {type(base).__name__} "
            f"({len(found)} ModuleLists named 'layers'); set train.shard=none"
        )
    return found[0]


def start_replicas(model: Any, train: TrainConfig, device: torch.device, dist: Dist) -> bool:
    """Rank 0's trainable weights on every rank (the replicas start equal), then split over
    the ranks with train.shard=fsdp (`shard_policy`). Returns whether it sharded."""
    dist.broadcast_parameters([p for p in model.parameters() if p.requires_grad])
    return shard_policy(model, train, device, dist)


def shard_policy(model: Any, train: TrainConfig, device: torch.device, dist: Dist) -> bool:
    """Wrap each decoder layer and the root with `fully_shard` (train.shard=fsdp, more than
    one process; every rank calls it with equal weights). Returns whether it sharded.

    On CUDA the units compute in bfloat16 and reduce gradients in float32
    (`MixedPrecisionPolicy`); `train.offload` keeps the shards in CPU memory between
    uses (CUDA only: on the CPU the shards are in CPU memory already, and it is refused)."""
    if train.shard != "fsdp":
        return False
    if train.offload and device.type != "cuda":
        raise ConfigError(
            f"train.offload=true keeps FSDP2's shards in CPU memory, and this run's model is "
            f"on {device.type} already: set train.offload=false"
        )
    if dist.world == 1:
        print(
            "note: train.shard=fsdp on one process: nothing to split, the model stays whole",
            file=sys.stderr,
        )
        return False
    wrap_units(model, train, device)
    return True


def wrap_units(model: Any, train: TrainConfig, device: torch.device) -> None:
    """`fully_shard` on each decoder layer and the root over the default process group,
    whatever its size: a group of one process gives FSDP2's path with nothing split (the
    GPU yardstick's one-process FSDP step, bench/checks/gpu_yardstick.py)."""
    options: dict[str, Any] = {}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if train.offload:
        options["offload_policy"] = CPUOffloadPolicy()
    # whether the logits are head(body): a check that runs the model, so taken whole and
    # on every rank alike; the update then scores through the root (forward/score.py)
    decoder_and_head(model)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for unit in units(model):  # a sum, not a mean: the losses are globally normalised
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    # the root's first forward makes it the root: before any submodule runs on its own
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()  # the root stays whole after a forward: the optimizer must see its shards
    # the whole weights just freed (loaded whole on every rank, then split) stay in glibc's
    # heap, where later tensors of other sizes rarely fit: given back, not kept resident;
    # and from now on large blocks (a phase's gathered weights) are given back when freed
    release_free_memory()
    fix_mmap_threshold()


def units(model: Any) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def full_weights(model: Any) -> Iterator[None]:
    """Whole weights on every rank for a phase of forward passes without gradients (a
    rollout phase, an eval, the old-logprob passes): one all-gather per unit on entry, no
    collective per forward, one reshard on exit. Re-entrant; with an unsharded model it
    does nothing. Every rank must enter and leave together."""
    if not is_sharded(model) or getattr(model, "_looprl_full", False):
        yield  # unsharded, or inside a phase that has them whole already
        return
    modules = units(model)
    for module in modules:
        module.unshard()
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    model._looprl_full = True
    try:
        yield
    finally:
        model._looprl_full = False
        for module in modules:
            # the root stays whole after its forward, as FSDP2 sets it (its backward follows)
            module.set_reshard_after_forward(module is not model, recurse=False)
            module.reshard()


@contextmanager
def rollout_weights(model: Any, engine: Any) -> Iterator[None]:
    """A rollout phase's weights (every rank enters it together). A sharded policy is
    first pushed to an engine that samples elsewhere (the vllm engine's `load_weights`:
    each tensor gathered in turn, engine/weight_push.py); the phase then holds whole
    weights in this process (`full_weights`) only where the engine reads the policy
    module: the hf engine samples with it, the vllm engine rescores forced calls with it
    (`rollout.vllm_rescore=policy`)."""
    if is_sharded(model):
        engine.load_weights()  # the hf engine's: nothing to do
        stats = getattr(engine, "push_stats", None)
        if stats is not None:  # pushed to a server, which ranks may share by URL:
            _note_push(stats)
            current().barrier()  # every rank's push is in before any rank samples
    with full_weights(model) if getattr(engine, "reads_policy", True) else nullcontext():
        yield


def _note_push(stats: Any) -> None:
    """The first push from shards, said once per process: how much it held at once."""
    global _push_noted
    if _push_noted or not stats.tensors:
        return
    _push_noted = True
    print(
        f"note: rank {current().rank}: weights pushed from shards, {stats.tensors} tensors "
        f"gathered in turn, at most {stats.peak_bytes:,} bytes at once of "
        f"{stats.total_bytes:,}",
        file=sys.stderr,
    )


_push_noted = False


def synced_passes(model: Any, items: Sequence[T], dist: Dist, every: bool = False) -> Iterator[T]:
    """`items` (this rank's micro-batches, for the caller's forward and backward), then
    passes of weight zero (`idle_pass`, run here) until every rank has made as many
    passes as the rank with the most; gradients are reduced over the ranks on the last
    pass only, or with `every` (train.shard_grad_sync=every) on each. Unsharded: `items`."""
    if not is_sharded(model):
        yield from items
        return
    count = int(dist.all_reduce([len(items)], op="max")[0])
    try:
        for index in range(count):
            model.set_requires_gradient_sync(every or index == count - 1)
            if index < len(items):
                yield items[index]
            else:
                idle_pass(model)
    finally:
        model.set_requires_gradient_sync(True)


def idle_pass(model: Any) -> None:
    """A forward and backward pass of weight zero on one token: the collectives of a
    micro-batch this rank does not have, and a zero gradient."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device)).logits
    (logits.float().sum() * 0.0).backward()


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_`, its total norm as a plain tensor: over sharded gradients it is a
    DTensor whose value is already the norm of the whole gradient."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
