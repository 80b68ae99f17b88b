"""One rank's memory under `train.shard: fsdp` over N processes (loop/shard.py), from the
one-process plan of the same run.

- Every phase: the weights, the adapters and the optimizer state are split N ways.
- Rollout phases (and the eval): the whole weights gathered once for the phase, beside
  the rank's shards; the rank plays 1/N of the episodes.
- The update: FSDP2 keeps the root's weights (embeddings, head, final norm) whole through
  the forward and backward, and two decoder layers whole at a time (the one computing
  and the next one's all-gather); over several micro-batches the gradients accumulate
  whole between the reductions (`set_requires_gradient_sync` on the last one) and only
  then shrink to 1/N (one micro-batch, or `train.shard_grad_sync: every`: 1/N, each
  layer's reduced as its backward ends);
  a micro-batch is one call of the whole model (no shared prompt pass: the token budget
  counts each episode's prompt, and the activations are those of every episode's whole
  sequence), whose head runs apart at the loss positions only, a chunk of rows at a time,
  as on one process (forward/score.py `root_call`).
"""

from __future__ import annotations

from looprl.config import Config
from looprl.plan.devices import Device
from looprl.plan.memory import (
    DTYPE_BYTES,
    HEAD_CHUNK,
    HEAD_COPIES,
    Phase,
    Plan,
    _micro_batch,
    _split,
    dtype_name,
    plan_memory,
)
from looprl.plan.shape import ModelShape
from looprl.plan.workload import Workload

LAYERS_IN_FLIGHT = 2  # FSDP2 gathers the next layer while one computes


def plan_for(cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int) -> Plan:
    """One rank's plan over `world` processes: the one-process plan, split where
    train.shard=fsdp splits it (a rank of an unsharded run holds what one process does)."""
    plan = plan_memory(cfg, shape, work, device)
    if world > 1 and cfg.train.shard == "fsdp":
        return sharded(plan, cfg, shape, work, device, world)
    return plan


def sharded(
    plan: Plan, cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int
) -> Plan:
    """`plan` (one process's) as one rank of `world` holds it with train.shard=fsdp."""
    b = DTYPE_BYTES[dtype_name(cfg, device)]
    lora = cfg.model.lora.enabled
    every = Phase("persistent", dict(plan.persistent.components), dict(plan.persistent.notes))
    for key in ("weights", "LoRA adapters", "optimizer state"):
        if key in every.components:
            every.add(key, every.components[key] / world, f"1/{world}: {every.notes.get(key, '')}")
            if cfg.train.offload:  # the shards live in CPU memory between uses
                every.add(key, 0.0, f"1/{world} in CPU memory (train.offload)")
    whole = shape.params * b + (shape.lora_params * 4 if lora else 0.0)
    phases = []
    for phase in plan.phases:
        if phase.name == "update":
            phases.append(_update(phase, cfg, shape, work, b, world))
            continue
        share = Phase(phase.name, dict(phase.components), dict(phase.notes))
        for key in ("KV cache", "logits", "prefill"):  # 1/N of the episodes, up to a batch
            if key in share.components:
                share.add(key, share.components[key] / world, f"1/{world} of the episodes")
        share.add("whole weights", whole, "gathered once for the phase (loop/shard.py)")
        phases.append(share)
    return Plan(every, phases)


def _update(
    phase: Phase, cfg: Config, shape: ModelShape, work: Workload, b: int, world: int
) -> Phase:
    out = Phase("update", dict(phase.components), dict(phase.notes))
    per_layer = (shape.params - shape.embedding_params) / max(shape.layers, 1)
    out.add("root weights whole", shape.embedding_params * b, "embeddings, head, final norm")
    out.add("layers in flight", LAYERS_IN_FLIGHT * per_layer * b, "two decoder layers gathered")
    _, tokens, _ = _micro_batch(cfg, work)
    groups = -(-cfg.rollout.tasks_per_step // cfg.algo.num_minibatches)
    mine = -(-groups // world)  # this rank's groups of a minibatch
    length = work.prompt_tokens + work.response_tokens  # each episode's prompt its own
    rows, whole_tokens, _ = _split(
        mine, cfg.rollout.group_size, cfg.train.micro_batch_tokens, 0, 0, length
    )
    scale = whole_tokens / max(tokens, 1)
    for key in ("activations", "backward temporaries", "freed blocks kept"):
        if key in out.components:
            note = f"micro-batch of {whole_tokens:,} tokens ({rows} episodes), whole sequences"
            out.add(key, out.components[key] * scale, note if key == "activations" else "")
    chunk = min(HEAD_CHUNK, max(rows * work.response_tokens, 1))
    out.add("logits", chunk * shape.vocab * 4 * HEAD_COPIES, f"{chunk} positions at a time")
    every = cfg.train.shard_grad_sync == "every"
    if every or rows >= mine * cfg.rollout.group_size:  # reduced layer by layer, each pass
        grads = out.components["gradients"]
        why = "train.shard_grad_sync=every" if every else "one micro-batch"
        out.add("gradients", grads / world, f"1/{world}: {why}, reduced as each pass ends")
    else:
        out.notes["gradients"] = "whole until the last micro-batch's reduction"
    return out
