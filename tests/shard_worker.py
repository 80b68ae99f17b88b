"""One process of tests/test_shard.py's comparisons: two policy updates (of two optimizer
steps each) of a tiny random model (the first of MODELS, comma-separated: tiny-random, or
a folder such as a tiny MoE model's) on fixed episodes, sharded (under torchrun,
train.shard=fsdp) or whole (one process). The episodes of ranks differ in length, so the
ranks run different numbers of micro-batches. Rank 0 writes the first gradient, the
losses and norms and the weights after the updates; every rank writes the bytes its
parameters, gradients and optimizer state hold (the tensors' local shards, as allocated).
Then it checkpoints that state both ways, sharded and whole, into OUT/sharded and
OUT/whole (run folders with the config), and reads back into a reset model every
checkpoint there is of this job and of the one-process job beside it (OUT/../one): the
weights and optimizer state each gives, whole, go into the result too. Each further model
of MODELS is only updated the same way, in the same launch, its result and memory written
into OUT/ITS_FOLDER_NAME.

    python tests/shard_worker.py OUT MODE MODELS          # one process
    torchrun --nproc_per_node 2 tests/shard_worker.py OUT MODE MODELS

MODE: lora or full, with -checkpointed for model.gradient_checkpointing, -every for
train.shard_grad_sync=every and -kl for a KL term to the base model (LoRA: the adapters
switched off for the reference pass).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from looprl.config import Config, config_from_dict
from looprl.forward.score import ROOT_CALL
from looprl.loop import dist as ranks
from looprl.loop import shard
from looprl.loop.batches import UpdateState
from looprl.loop.checkpoint import (
    load_training_state,
    load_weights,
    save_checkpoint,
    trainable_state,
    whole,
)
from looprl.loop.groups import Group
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import Policy, load_policy
from looprl.loop.reference import keep_reference
from looprl.loop.sft import sft_step
from looprl.loop.shard import start_replicas
from looprl.loop.train import write_config
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


def weights_now(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights, whole, copied (one process's are views of the parameters)."""
    return {name: tensor.clone() for name, tensor in trainable_state(model).items()}


def local_bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def count_idle_passes() -> SimpleNamespace:
    """The update's passes of weight zero on this rank, counted as they run (`count`;
    `real`: the function counted)."""
    counter = SimpleNamespace(count=0, real=shard.idle_pass)

    def counted(*args: object) -> None:
        counter.count += 1
        counter.real(*args)

    shard.idle_pass = counted
    return counter


def worker_config(mode: str, model: str, reference: str) -> Config:
    return config_from_dict(
        {
            "model": {
                "name": model,
                "lora": {"enabled": mode.startswith("lora"), "rank": 4},
                "gradient_checkpointing": "-checkpointed" in mode,
            },
            "algo": {
                "num_minibatches": 2,
                "kl_coef": 0.1 if "-kl" in mode else 0.0,
                "kl_reference": reference,
            },
            "train": {
                "micro_batch_tokens": 64,
                "shard": "fsdp",
                "shard_grad_sync": "every" if "-every" in mode else "last",
                "lr": 1e-3,
            },
        }
    )


def updated(out: Path, mode: str, model: str, dist: ranks.Dist) -> tuple:
    """MODEL loaded (sharded over the ranks under torchrun) and updated twice on the fixed
    episodes: the policy, its optimizer, the groups, and the stats, the first gradient and
    the weights after (rank 0's are whole). Writes OUT/memory_RANK.json."""
    cfg = worker_config(mode, model, "base")
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
    for step in range(2):
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
    shard.idle_pass = idle.real
    states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    memory = {
        "params": local_bytes(list(policy.model.parameters())),
        "trainable": local_bytes(params),
        "grads": seen["grad_bytes"],
        "optimizer": local_bytes(states),
        "idle_passes": idle.count,
        "checkpointed": sum(hasattr(m, CHECKPOINTED) for m in policy.model.modules()),
        "root_calls": hasattr(policy.model, ROOT_CALL),  # the head apart: no [B, S, V] logits
    }
    (out / f"memory_{dist.rank}.json").write_text(json.dumps(memory))
    return (
        policy,
        optimizer,
        groups,
        {"stats": stats, "grads": seen["grads"], "weights": weights_now(policy.model)},
    )


def main(out: Path, mode: str, models: str) -> None:
    """The first of MODELS (comma-separated) updated, checkpointed both ways, read back and
    warm-started; each further one only updated, into OUT/ITS_FOLDER_NAME."""
    dist = ranks.start()
    first, *more = models.split(",")
    policy, optimizer, groups, result = updated(out, mode, first, dist)
    cfg = worker_config(mode, first, "base")
    save_both_ways(out, policy, optimizer, cfg)
    result["resumed"] = read_back(list(dict.fromkeys([out.parent / "one", out])), cfg, dist)
    anchored = worker_config(mode, first, "start" if "-kl" in mode else "base")
    warm = warm_start_and_anchor(out, policy, groups, anchored, dist)
    if dist.is_main:
        torch.save({**result, **warm}, out / "result.pt")
    for model in more:
        folder = out / Path(model).name
        folder.mkdir(exist_ok=True)
        result = updated(folder, mode, model, dist)[-1]
        if dist.is_main:
            torch.save(result, folder / "result.pt")
    ranks.stop()


def warm_start_and_anchor(
    out: Path, policy: Policy, groups: list[Group], cfg: Config, dist: ranks.Dist
) -> dict:
    """An SFT step on the groups' episodes (a sharded model: each rank its share); then,
    with a KL term (LoRA), the weights as they are kept as the reference
    (algo.kl_reference=start) and read back from RUN/checkpoints/rl_start as a resumed run
    reads them, and one update anchored to them. The whole weights after each, and the
    reference as kept and as read back."""
    episodes = [e for group in groups for e in group.episodes]
    params = policy.trainable_parameters()
    stats = sft_step(policy, make_optimizer(params, "adamw", 1e-3, 0.01), episodes, cfg, dist)
    warm = {"sft_loss": stats["sft/loss"], "after_sft": weights_now(policy.model)}
    if cfg.algo.kl_coef == 0:
        return warm
    keep_reference(cfg, policy, out, dist, 0)
    kept = {name: whole(tensor) for name, tensor in policy.reference.items()}
    keep_reference(cfg, policy, out, dist, 1)  # a resumed run: RUN/checkpoints/rl_start
    reread = {name: whole(tensor) for name, tensor in policy.reference.items()}
    with torch.no_grad():  # the policy moves off its start, so the reference pass matters
        for param in params:
            param.add_(0.01)
    optimizer = make_optimizer(params, "adamw", cfg.train.lr, 0.0)
    result = update_policy(
        policy,
        optimizer,
        dist.share(groups),
        cfg.algo,
        cfg.train,
        group_size=GROUP,
        max_tokens=64,
        seed=7,
        state=UpdateState(64),
        dist=dist,
    )
    anchored = weights_now(policy.model)
    return {**warm, "kept": kept, "reread": reread, "anchored": anchored, "kl": result["kl"]}


def scheduler_of(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def save_both_ways(out: Path, policy: object, optimizer: torch.optim.Optimizer, cfg) -> None:
    scheduler = scheduler_of(optimizer)
    scheduler.step()
    for kind in ("sharded", "whole"):
        run = out / kind
        save_checkpoint(
            run, 3, policy.model, optimizer, scheduler, {}, 1, sharded=kind == "sharded"
        )
        if ranks.current().is_main:
            write_config(run, cfg)


def whole_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The trainable weights and the optimizer's state and learning rate, whole, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for param, values in optimizer.state.items():
        for stat, value in values.items():
            moments[f"{names[id(param)]}/{stat}"] = whole(value)
    return {
        "weights": trainable_state(model),
        "optimizer": moments,
        "lr": optimizer.param_groups[0]["lr"],
    }


def read_back(jobs: list[Path], cfg, dist: ranks.Dist) -> dict[str, dict]:
    """Each checkpoint of `jobs` read into one model, reset to zeros before each."""
    policy = load_policy(cfg)
    start_replicas(policy.model, cfg.train, policy.device, dist)
    optimizer = make_optimizer(policy.trainable_parameters(), "adamw", cfg.train.lr, 0.0)
    scheduler = scheduler_of(optimizer)
    out = {}
    for job in jobs:
        for kind in ("sharded", "whole"):
            checkpoint = job / kind / "checkpoints" / "step_000003"
            if not checkpoint.exists():
                continue
            with torch.no_grad():
                for param in policy.trainable_parameters():
                    param.zero_()
            optimizer.state.clear()
            load_weights(policy.model, checkpoint)
            load_training_state(checkpoint, policy.model, optimizer, scheduler)
            out[f"{job.name}/{kind}"] = whole_state(policy.model, optimizer)
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
