"""Whether a plan fits a device, the largest batch settings that do, and what to change
when nothing does: each change is planned again and its peak shown, not guessed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from looprl.config import Config
from looprl.loop.batches import MIN_MICRO_BATCH_TOKENS
from looprl.plan.devices import DEVICES, Device
from looprl.plan.memory import Plan, dtype_name, summary
from looprl.plan.shape import ModelShape
from looprl.plan.sharding import plan_for
from looprl.plan.workload import Workload


def _peak(cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int = 1) -> float:
    return plan_for(cfg, shape, work, device, world).peak()[1]


def _with(cfg: Config, section: str, **values: Any) -> Config:
    part = getattr(cfg, section).model_copy(update=values)
    return cfg.model_copy(update={section: part})


def largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n), for a fits that only turns false as n
    grows; None if even `low` does not fit."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def largest_settings(
    cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int = 1
) -> dict:
    """The largest `rollout.batch_size` and `train.micro_batch_tokens` that fit, each with
    the other left as configured. Each search stops where a larger value no longer changes
    the plan (every episode in one batch, a whole minibatch in one micro-batch)."""
    episodes = max(
        cfg.rollout.tasks_per_step * cfg.rollout.group_size,
        cfg.eval.tasks * cfg.eval.samples_per_task,
        cfg.eval.greedy_count,
    )
    minibatch = -(-cfg.rollout.tasks_per_step // cfg.algo.num_minibatches) * cfg.rollout.group_size
    tokens = minibatch * (work.prompt_tokens + work.response_tokens)

    def batch_fits(n: int) -> bool:
        changed = _with(cfg, "rollout", batch_size=n)
        return _peak(changed, shape, work, device, world) <= device.usable

    def micro_fits(n: int) -> bool:
        changed = _with(cfg, "train", micro_batch_tokens=n)
        return _peak(changed, shape, work, device, world) <= device.usable

    batch_top = episodes
    micro_top = max(tokens, MIN_MICRO_BATCH_TOKENS)
    return {
        "rollout.batch_size": {"value": largest(batch_fits, 1, batch_top), "search_max": batch_top},
        "train.micro_batch_tokens": {
            "value": largest(micro_fits, MIN_MICRO_BATCH_TOKENS, micro_top),
            "search_max": micro_top,
        },
    }


def advice(
    cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int = 1
) -> list[dict]:
    """Changes that lower the peak, each planned again: sharding over the processes (at
    least 2) and, on a GPU, its offload; LoRA, 8-bit AdamW, gradient checkpointing,
    bfloat16 weights, smaller batches."""
    out = sharding_advice(cfg, shape, work, device, world)
    options: list[tuple[str, Config]] = []
    if not cfg.model.lora.enabled:
        lora = cfg.model.lora.model_copy(update={"enabled": True})
        options.append(("model.lora.enabled=true", _with(cfg, "model", lora=lora)))
    if cfg.train.optimizer == "adamw":
        options.append(("train.optimizer=adamw_8bit", _with(cfg, "train", optimizer="adamw_8bit")))
    if not cfg.model.gradient_checkpointing:
        options.append(
            ("model.gradient_checkpointing=true", _with(cfg, "model", gradient_checkpointing=True))
        )
    if dtype_name(cfg, device) == "float32":
        options.append(("model.dtype=bfloat16", _with(cfg, "model", dtype="bfloat16")))
    if cfg.rollout.batch_size > 8:
        options.append(("rollout.batch_size=8", _with(cfg, "rollout", batch_size=8)))
    if cfg.train.micro_batch_tokens > 512:
        options.append(
            ("train.micro_batch_tokens=512", _with(cfg, "train", micro_batch_tokens=512))
        )
    for change, changed in options:
        peak = _peak(changed, shape, work, device, world)
        out.append({"set": change, "peak_bytes": peak, "fits": peak <= device.usable})
    return sorted(out, key=lambda item: item["peak_bytes"])


def sharding_advice(
    cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int
) -> list[dict]:
    """train.shard=fsdp over `world` processes (2 when planned for one); once sharded, the
    gradients reduced after every micro-batch and, on a GPU, the offload; each planned
    again at that world size."""
    options: list[tuple[str, Config, int]] = []
    if cfg.train.shard == "none":
        over = max(world, 2)
        sharded = _with(cfg, "train", shard="fsdp")
        options.append((f"train.shard=fsdp (torchrun, {over} processes)", sharded, over))
    else:
        if cfg.train.shard_grad_sync == "last":
            every = _with(cfg, "train", shard_grad_sync="every")
            options.append(("train.shard_grad_sync=every", every, world))
        if device.kind == "cuda" and not cfg.train.offload:
            options.append(("train.offload=true", _with(cfg, "train", offload=True), world))
    out = []
    for change, changed, size in options:
        peak = _peak(changed, shape, work, device, size)
        out.append({"set": change, "peak_bytes": peak, "fits": peak <= device.usable})
    return out


def full_plan(
    cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int = 1
) -> dict:
    """Everything `looprl plan` prints, as one JSON-ready dict: one rank's plan over
    `world` processes."""
    plan: Plan = plan_for(cfg, shape, work, device, world)
    result = summary(plan)
    peak = result["peak_bytes"]
    result.update(
        model=shape.to_dict(),
        workload=work.to_dict(),
        dtype=dtype_name(cfg, device),
        device={
            "name": device.name,
            "memory_bytes": device.memory,
            "usable_bytes": device.usable,
            "unified": device.unified,
            "about": device.about,
        },
        fits=peak <= device.usable,
        world_size=world,
        shard=cfg.train.shard if world > 1 else "none",
        largest=largest_settings(cfg, shape, work, device, world),
        advice=[] if peak <= device.usable else advice(cfg, shape, work, device, world),
        devices={n: _verdict(cfg, shape, work, d, world) for n, d in DEVICES.items()},
    )
    return result


def _verdict(cfg: Config, shape: ModelShape, work: Workload, device: Device, world: int) -> dict:
    peak = _peak(cfg, shape, work, device, world)
    return {"peak_bytes": peak, "fits": peak <= device.usable}
