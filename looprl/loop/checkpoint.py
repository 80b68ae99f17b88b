"""Checkpoints: trainable weights + optimizer + scheduler + RNG states + step.

A checkpoint is written into a temporary folder and renamed into place, so a crash in
the middle of a write leaves the previous checkpoint intact. The newest `keep` are kept.
Whole checkpoints hold `trainable.safetensors` and `state.pt`; sharded ones
(`train.shard_checkpoint: sharded`, loop/checkpoint_sharded.py) each rank's shards in
`sharded/`. Every reader here takes either.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from looprl.config import TrainConfig
from looprl.forward.score import is_sharded
from looprl.loop import dist as ranks
from looprl.loop.checkpoint_sharded import (
    is_sharded_checkpoint,
    load_sharded_optimizer,
    load_sharded_weights,
    read_weights,
    save_sharded,
)

PREFIX = "step_"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole, on the CPU: a sharded one (DTensor, train.shard=fsdp) gathered from
    every rank, so every rank must call this for it in the same order."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().contiguous().cpu()


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The trainable weights, whole (sharded ones gathered: every rank calls it)."""
    return {name: whole(p) for name, p in model.named_parameters() if p.requires_grad}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with whole tensors (sharded ones gathered: every rank calls
    it): the same file at any number of processes, sharded or not."""
    state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own
    state["state"] = {
        index: {k: whole(v) if isinstance(v, DTensor) else v for k, v in values.items()}
        for index, values in state["state"].items()
    }
    return state


def place(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as `like`: its device and dtype, and its shard where `like`
    is sharded (each rank keeps its own part of the whole it read; no collective)."""
    tensor = tensor.to(like.device, like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(tensor, like.device_mesh, like.placements, src_data_rank=None)
    return tensor


def writes_shards(train: TrainConfig) -> bool:
    """Whether this run's checkpoints are each rank's shards (loop/checkpoint_sharded.py)."""
    return train.shard == "fsdp" and train.shard_checkpoint == "sharded"


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    keep: int,
    sharded: bool,
) -> Path | None:
    """Every rank calls it; rank 0 returns the folder, the others None. `sharded`: each
    rank writes its own shards (loop/checkpoint_sharded.py); else a sharded model's
    weights and optimizer state are gathered whole and rank 0 writes them."""
    main = ranks.current().is_main
    if not (main or is_sharded(model)):
        return None
    root = run_dir / "checkpoints"
    final = root / f"{PREFIX}{step:06d}"
    meta = {"step": step, **extra}
    if sharded:
        state = {"scheduler": scheduler.state_dict(), "rng": rng_state()}
        written = save_sharded(final, model, optimizer, state, meta)
    else:
        written = _save_whole(final, model, optimizer, scheduler, meta)
    if written is not None:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return written


def _save_whole(
    final: Path, model: Any, optimizer: Any, scheduler: Any, meta: dict[str, Any]
) -> Path | None:
    state = {
        "optimizer": optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
    }
    weights = trainable_state(model)
    if not ranks.current().is_main:
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".tmp-*"):  # left by a writer that was killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    return write_weights(
        final, weights, meta, also=lambda folder: torch.save(state, folder / "state.pt")
    )


def save_weights(folder: Path, model: Any, meta: dict[str, Any], sharded: bool) -> Path | None:
    """The model's trainable weights and `meta`. Every rank calls it; rank 0 returns the
    folder. `sharded` (`writes_shards`): each rank writes its own shards, as a step
    checkpoint's (loop/checkpoint_sharded.py); else a sharded model's weights are gathered
    whole and rank 0 writes `trainable.safetensors` (`write_weights`). Weights alone are
    not resumable, but load wherever a checkpoint does (eval, chat, serve, export)."""
    if not (ranks.current().is_main or is_sharded(model)):
        return None
    if sharded:
        return save_sharded(folder, model, None, None, meta)
    weights = trainable_state(model)
    return write_weights(folder, weights, meta) if ranks.current().is_main else None


def write_weights(
    folder: Path,
    weights: dict[str, torch.Tensor],
    meta: dict[str, Any],
    also: Callable[[Path], None] | None = None,
) -> Path:
    """`weights` and `meta` (and what `also` writes beside them: a checkpoint's optimizer
    state), written into a temporary folder renamed to `folder`: whole or not at all over
    what `folder` held."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        save_file(weights, str(tmp / "trainable.safetensors"))
        if also is not None:
            also(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").exists()
    )


def has_weights(checkpoint: Path) -> bool:
    """A folder with trainable weights, whole or sharded."""
    return (checkpoint / "trainable.safetensors").is_file() or is_sharded_checkpoint(checkpoint)


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights, whole, on the CPU of this process."""
    if is_sharded_checkpoint(checkpoint):
        return read_weights(checkpoint)
    return load_file(str(checkpoint / "trainable.safetensors"))


def load_weights(model: Any, checkpoint: Path) -> dict[str, Any]:
    """Load a checkpoint's trainable weights into `model`; return its metadata. A sharded
    model reads a sharded checkpoint shard by shard (every rank calls it); otherwise the
    weights are read whole and each rank keeps its shard where the model is sharded."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    if is_sharded_checkpoint(checkpoint) and is_sharded(model):
        load_sharded_weights(model, checkpoint)
        return meta
    state = checkpoint_weights(checkpoint)
    params = dict(model.named_parameters())
    missing = [name for name in state if name not in params]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} does not fit this model: {missing[:3]} ...")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(place(tensor, params[name]))
    return meta


def load_training_state(checkpoint: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The optimizer's state, each rank keeping its shard of it where the weights are
    sharded; the schedule; the random states."""
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    if is_sharded_checkpoint(checkpoint):
        load_sharded_optimizer(checkpoint, model, optimizer, state["param_groups"])
    else:
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:
            for param in group["params"]:
                values = optimizer.state.get(param, {})
                for key, value in values.items():
                    if isinstance(param, DTensor) and getattr(value, "shape", None) == param.shape:
                        values[key] = place(value, param)
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])


def export_model(run_dir: Path, out: Path, checkpoint: Path | None = None) -> Path:
    """Write a plain transformers model folder (LoRA merged into the weights) plus the
    tokenizer, loadable with `AutoModelForCausalLM.from_pretrained(out)`."""
    from looprl.config import load_config
    from looprl.loop.policy import load_policy

    cfg = load_config(run_dir / "config.yaml", ["model.device=cpu"])
    checkpoints = list_checkpoints(run_dir)
    checkpoint = checkpoint or (checkpoints[-1] if checkpoints else None)
    if checkpoint is None:
        raise ValueError(f"{run_dir} has no checkpoint to export")
    policy = load_policy(cfg)
    load_weights(policy.model, checkpoint)
    model = policy.model
    if cfg.model.lora.enabled:
        model = model.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    policy.tokenizer.save_pretrained(out)
    return out
