"""One process of tests/test_shard_push.py: the vllm engine's weight files written from a
sharded policy (under torchrun, train.shard=fsdp), full fine-tuning's and a LoRA
adapter's, each tensor gathered in turn. Each rank writes its files into OUT/KIND_RANK,
its push's measures into OUT/KIND_RANK.json, and rank 0 the whole trainable weights
(gathered at once, the reference) into OUT/KIND_whole.pt.

    torchrun --nproc_per_node 2 tests/push_worker.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from looprl.config import load_config
from looprl.engine.weight_push import (
    PushStats,
    save_adapter_in_turn,
    save_in_turn,
    whole_in_turn,
)
from looprl.loop import dist as ranks
from looprl.loop.checkpoint import trainable_state
from looprl.loop.policy import load_policy
from looprl.loop.shard import start_replicas
from looprl.model.load import base_model


def push(out: Path, lora: bool, dist: ranks.Dist) -> None:
    cfg = load_config(
        None, ["model.name=tiny-random", f"model.lora.enabled={lora}", "train.shard=fsdp"]
    )
    policy = load_policy(cfg)
    model = policy.model
    with torch.no_grad():  # rank 0's values reach every rank (start_replicas)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)  # LoRA's B is no longer zero
    assert start_replicas(model, cfg.train, policy.device, dist)
    kind = "lora" if lora else "full"
    folder = out / f"{kind}_{dist.rank}"
    stats = PushStats()
    if lora:
        save_adapter_in_turn(model, folder, stats)
    else:
        folder.mkdir(parents=True)
        save_in_turn(folder / "weights.safetensors", base_model(model).named_parameters(), stats)
    pushed = [p for n, p in model.named_parameters() if not lora or "lora_" in n]
    kept = PushStats()  # a consumer that keeps what it gets holds it all at once
    held = list(whole_in_turn(((str(i), p) for i, p in enumerate(pushed)), kept))
    del held
    measures = {
        "tensors": stats.tensors,
        "total_bytes": stats.total_bytes,
        "peak_bytes": stats.peak_bytes,
        "kept_peak_bytes": kept.peak_bytes,
        "largest_bytes": max(p.numel() * p.element_size() for p in pushed),
        "all_sharded": all(isinstance(p, DTensor) for p in pushed),
        "count": len(pushed),
    }
    (out / f"{kind}_{dist.rank}.json").write_text(json.dumps(measures))
    whole = trainable_state(model)  # every rank: gathered
    if dist.is_main:
        torch.save(whole, out / f"{kind}_whole.pt")


def main(out: Path) -> None:
    dist = ranks.start()
    torch.manual_seed(0)
    for lora in (False, True):
        push(out, lora, dist)
    ranks.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
