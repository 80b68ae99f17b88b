"""One process of tests/test_shard.py's comparisons: three policy updates of a tiny random
model on fixed episodes, sharded (under torchrun, train.shard=fsdp) or whole (one
process). The episodes of ranks differ in length, so the ranks run different numbers of
micro-batches. Rank 0 writes the first gradient, the losses and norms and the weights
after the updates; every rank writes the bytes its parameters, gradients and optimizer
state hold (the tensors' local shards, as allocated).

    python tests/shard_worker.py OUT MODE          # one process
    torchrun --nproc_per_node 2 tests/shard_worker.py OUT MODE

MODE: lora or full, with -checkpointed for model.gradient_checkpointing and -every for
train.shard_grad_sync=every.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from looprl.config import config_from_dict
from looprl.loop import dist as ranks
from looprl.loop import shard
from looprl.loop.batches import UpdateState
from looprl.loop.checkpoint import trainable_state, whole
from looprl.loop.groups import Group
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import load_policy
from looprl.loop.shard import start_replicas
from looprl.loop.update import update_policy
from looprl.model.memory import CHECKPOINTED
from looprl.types import Episode, Task

TASKS, GROUP = 4, 2


def episodes_of(task: int, vocab: int) -> list[Episode]:
    """A task's group: the first half of the tasks long (several micro-batches of 64
    tokens), the second half short (one)."""
    gen = torch.Generator().manual_seed(task)
    prompt = torch.randint(5, vocab, (8,), generator=gen).tolist()
    out = []
    for member in range(GROUP):
        length = (40 if task < TASKS // 2 else 6) + member
        reply = torch.randint(5, vocab, (length,), generator=gen).tolist()
        out.append(
            Episode(
                Task(f"t{task}", {}),
                [],
                prompt + reply,
                [0] * 8 + [1] * length,
                [0.0] * 8 + [-1.0] * length,
            )
        )
    return out


def local_bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def count_idle_passes() -> list[int]:
    """The update's passes of weight zero on this rank, counted as they run."""
    count = [0]
    real = shard.idle_pass

    def counted(*args: object) -> None:
        count[0] += 1
        real(*args)

    shard.idle_pass = counted
    return count


def main(out: Path, mode: str) -> None:
    dist = ranks.start()
    cfg = config_from_dict(
        {
            "model": {
                "name": "tiny-random",
                "lora": {"enabled": mode.startswith("lora"), "rank": 4},
                "gradient_checkpointing": mode.endswith("-checkpointed"),
            },
            "algo": {"num_minibatches": 2},
            "train": {
                "micro_batch_tokens": 64,
                "shard": "fsdp",
                "shard_grad_sync": "every" if "-every" in mode else "last",
                "lr": 1e-3,
            },
        }
    )
    torch.manual_seed(0)
    policy = load_policy(cfg)
    start_replicas(policy.model, cfg.train, policy.device, dist)
    params = policy.trainable_parameters()
    optimizer = make_optimizer(params, "adamw", cfg.train.lr, 0.0)
    seen: dict[str, object] = {}

    def record(opt: torch.optim.Optimizer, *_: object) -> None:
        if "grads" not in seen:  # the first optimizer step's gradient, whole
            names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
            seen["grads"] = {n: whole(p.grad) for n, p in zip(names, params)}
            seen["grad_bytes"] = local_bytes([p.grad for p in params])

    optimizer.register_step_pre_hook(record)
    idle = count_idle_passes()
    vocab = len(policy.tokenizer)
    groups = [Group(Task(f"t{t}", {}), episodes_of(t, vocab), [1.0, -1.0]) for t in range(TASKS)]
    stats = []
    for step in range(3):
        result = update_policy(
            policy,
            optimizer,
            dist.share(groups),
            cfg.algo,
            cfg.train,
            group_size=GROUP,
            max_tokens=64,
            seed=step,
            state=UpdateState(64),
            dist=dist,
        )
        stats.append({k: result[k] for k in ("loss", "grad_norm", "updated")})
    states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    memory = {
        "params": local_bytes(list(policy.model.parameters())),
        "trainable": local_bytes(params),
        "grads": seen["grad_bytes"],
        "optimizer": local_bytes(states),
        "idle_passes": idle[0],
        "checkpointed": sum(hasattr(m, CHECKPOINTED) for m in policy.model.modules()),
    }
    weights = trainable_state(policy.model)
    (out / f"memory_{dist.rank}.json").write_text(json.dumps(memory))
    if dist.is_main:
        torch.save({"stats": stats, "grads": seen["grads"], "weights": weights}, out / "result.pt")
    ranks.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
