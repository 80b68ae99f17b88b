"""Sharded checkpoints (`train.shard: fsdp`, `train.shard_checkpoint: sharded`): each rank
writes its own shard of the trainable weights and of the optimizer state with
`torch.distributed.checkpoint` (DCP), so no rank ever holds the whole trainable state.

A sharded checkpoint folder holds `sharded/` (DCP's files: `.metadata` and one
`__R_0.distcp` per rank), `state.pt` (the schedule, the random states and the optimizer's
hyperparameters, written by rank 0) and `meta.json`, written last. Its keys are the
parameters' names, as in `trainable.safetensors`: `weights/NAME` and
`optimizer/NAME/STAT` (AdamW's `exp_avg`, `exp_avg_sq`, `step`).

Reading reshards: ranks of a sharded model each read the parts of their own shards (any
world size: DCP maps the saved pieces onto the new layout); a whole model, on one
process and with no process group (resume, `looprl export`, `eval`, `serve`), reads the
whole tensors from every rank's file.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from looprl.forward.score import is_sharded
from looprl.loop import dist as ranks

FOLDER = "sharded"  # DCP's files inside a checkpoint folder
WEIGHTS, OPTIMIZER = "weights/", "optimizer/"


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns on every read or write without a process group; on one process that is
    what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    return (checkpoint / FOLDER / ".metadata").is_file()


def save_sharded(
    final: Path,
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any] | None,
    meta: dict[str, Any],
) -> Path | None:
    """Every rank calls it. Each rank writes its shards into a temporary folder beside
    `final`; rank 0 then writes `state` (plus the optimizer's hyperparameters) and `meta`,
    last, and renames the folder into place: a write cut short leaves a `.tmp-` folder
    that no reader lists. Rank 0 returns the folder, the others None. A whole model (one
    process) is written by rank 0 alone, in the same layout. Without an optimizer (and
    `state`): the weights alone (`checkpoints/best`, `checkpoints/rl_start`)."""
    dist = ranks.current()
    sharded = is_sharded(model)
    if not (dist.is_main or sharded):
        return None
    tmp = final.parent / f".tmp-{final.name}"
    if dist.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(".tmp-*"):  # left by a writer killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
    if sharded:
        dist.barrier()  # the stale folders are gone before any rank writes
    tensors = _weights(model)
    if optimizer is not None:
        tensors.update(_optimizer_tensors(model, optimizer))
    with _one_process():
        dcp.save(tensors, checkpoint_id=tmp / FOLDER, no_dist=not sharded)
    if dist.is_main:  # dcp.save returns on rank 0 once every rank's file is written
        if optimizer is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            torch.save({**(state or {}), "param_groups": groups}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if sharded:
        dist.barrier()  # no rank reads the checkpoint before it is in place
    return final if dist.is_main else None


def _weights(model: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters as DCP's keys: DTensors are written shard by shard."""
    return {WEIGHTS + n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _optimizer_tensors(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter tensors, keyed by the parameter's name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for param, values in optimizer.state.items():
        for stat, value in values.items():
            if isinstance(value, torch.Tensor):
                out[f"{OPTIMIZER}{names[id(param)]}/{stat}"] = value
    return out


def _stored(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    metadata = dcp.FileSystemReader(str(checkpoint / FOLDER)).read_metadata()
    return {
        key: item
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _whole_targets(stored: dict[str, TensorStorageMetadata], prefix: str) -> dict[str, Any]:
    return {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in stored.items()
        if key.startswith(prefix)
    }


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trainable weights of a sharded checkpoint, whole, on the CPU of this one
    process (every rank's file read; no process group needed): `trainable.safetensors`'s
    contents, for a whole model, `looprl export`, `eval` and `serve`."""
    targets = _whole_targets(_stored(checkpoint), WEIGHTS)
    with _one_process():
        dcp.load(targets, checkpoint_id=checkpoint / FOLDER, no_dist=True)
    return {key.removeprefix(WEIGHTS): tensor for key, tensor in targets.items()}


def load_sharded_weights(model: Any, checkpoint: Path) -> None:
    """A sharded model's trainable weights: each rank reads the parts of its own shards
    (every rank calls it)."""
    stored = _stored(checkpoint)
    params = dict(model.named_parameters())
    missing = [k.removeprefix(WEIGHTS) for k in stored if k.startswith(WEIGHTS)]
    missing = [name for name in missing if name not in params]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} does not fit this model: {missing[:3]} ...")
    targets = _weights(model)
    with torch.no_grad(), _one_process():
        dcp.load(targets, checkpoint_id=checkpoint / FOLDER, no_dist=not is_sharded(model))


def read_sharded_like(checkpoint: Path, params: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A sharded checkpoint's weights laid out as `params` (name -> parameter): each rank
    reads its own shard of each where they are sharded (every rank calls it), into new
    tensors; the model's own weights are left as they are."""
    stored = [k.removeprefix(WEIGHTS) for k in _stored(checkpoint) if k.startswith(WEIGHTS)]
    missing = [name for name in stored if name not in params]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} does not fit this model: {missing[:3]} ...")
    targets = {WEIGHTS + name: torch.empty_like(params[name].detach()) for name in stored}
    sharded = any(isinstance(t, DTensor) for t in targets.values())
    with _one_process():
        dcp.load(targets, checkpoint_id=checkpoint / FOLDER, no_dist=not sharded)
    return {key.removeprefix(WEIGHTS): tensor for key, tensor in targets.items()}


def load_sharded_optimizer(
    checkpoint: Path, model: Any, optimizer: torch.optim.Optimizer, groups: list[dict]
) -> None:
    """The optimizer's state from a sharded checkpoint, laid out as the parameters are
    now (a rank's shard of each, or whole), and its hyperparameters (`groups`, from
    `state.pt`)."""
    params = dict(model.named_parameters())
    targets: dict[str, Any] = {}
    for key, item in _stored(checkpoint).items():
        if not key.startswith(OPTIMIZER):
            continue
        name, _ = key.removeprefix(OPTIMIZER).rsplit("/", 1)
        param = params[name]
        if tuple(item.size) == tuple(param.shape):  # a moment: sharded as its parameter
            targets[key] = torch.zeros_like(param, dtype=item.properties.dtype)
        else:  # a scalar (AdamW's step): whole on every rank
            targets[key] = torch.zeros(item.size, dtype=item.properties.dtype)
    with _one_process():
        dcp.load(targets, checkpoint_id=checkpoint / FOLDER, no_dist=not is_sharded(model))
    optimizer.state.clear()
    for key, tensor in targets.items():
        name, stat = key.removeprefix(OPTIMIZER).rsplit("/", 1)
        optimizer.state[params[name]][stat] = tensor
    for group, values in zip(optimizer.param_groups, groups):
        group.update(values)
