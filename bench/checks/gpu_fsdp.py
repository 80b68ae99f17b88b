"""The GPU yardstick's FSDP step (bench/checks/gpu_yardstick.py, `--parts fsdp`): one
process's update of SmolLM2-135M (`--tiny`: tiny-random), full fine-tuning, through the
FSDP2 units of `train.shard: fsdp` over a process group of one, so nothing is split: on
CUDA the units compute in bfloat16 and reduce gradients in float32
(`MixedPrecisionPolicy`), the update scores through the root (forward/score.py
`root_call`), and clipping reads a DTensor norm. A run with one process keeps its model
whole (loop/shard.py), so the group and the units are made here."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist

from bench.harness import print_result
from looprl.loop.shard import wrap_units


def fsdp_part(sizes: Any, tiny: bool, device: torch.device, measure: Callable) -> dict:
    """`measure` (the yardstick's `measure_update`) of the FSDP2-wrapped model, on the
    update part's episodes and micro-batches (`sizes`): the summary's `fsdp_step_s`, the
    seconds of one update (median of the repeats after a warm-up), and `fsdp_peak_gb`."""
    overrides = [
        "model.name=" + ("tiny-random" if tiny else "smollm2-135m"),
        f"model.device={device.type}",
        "model.lora.enabled=false",
        "train.shard=fsdp",
        f"rollout.tasks_per_step={sizes.tasks}",
        f"rollout.group_size={sizes.group}",
        f"rollout.max_new_tokens={sizes.response}",
        f"train.micro_batch_tokens={sizes.micro_batch_tokens}",
        "algo.num_minibatches=1",
    ]
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        measured = measure(overrides, sizes, device, wrap=wrap_units)
    finally:
        torch_dist.destroy_process_group()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seconds = measured["tokens"] / measured["tokens_per_s"]
    print_result(
        {
            "update": "full",
            "shard": "fsdp-1-process",
            "tokens": measured["tokens"],
            "micro_batch_tokens": sizes.micro_batch_tokens,
            "step_s": f"{seconds:.2f}",
            "peak_gb": f"{measured['peak'] / 1e9:.2f}",
        }
    )
    return {"fsdp_step_s": f"{seconds:.2f}", "fsdp_peak_gb": f"{measured['peak'] / 1e9:.2f}"}
