"""The `vllm` engine's weight push, one tensor at a time: each weight is made whole in turn
(a sharded one, an FSDP2 DTensor under `train.shard: fsdp`, gathered from every rank)
and written into a safetensors file at its place, then dropped before the next one. So
a push never holds more than one whole tensor beside the policy's own weights, sharded
or not.

The file is the format safetensors reads (an 8-byte header length, a JSON header naming
each tensor's dtype, shape and byte range, then the bytes in that order), written
progressively: every tensor's dtype and shape is known before any is gathered (a
DTensor has its whole shape), so the header comes first and each tensor's bytes follow
as it arrives.

Gathering is a collective: with a sharded policy every rank must push, with the same
tensors in the same order (loop/shard.py `rollout_weights` calls it on every rank at a
rollout phase's start).
"""

from __future__ import annotations

import copy
import json
import struct
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from looprl.errors import EngineError

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class PushStats:
    """What the last push gathered: how many tensors, their bytes in all, and the most
    bytes of gathered tensors alive at once (measured: the tensors handed out and not yet
    freed when the next one is gathered)."""

    tensors: int = 0
    total_bytes: int = 0
    peak_bytes: int = 0


def whole_in_turn(
    named: Iterable[tuple[str, torch.Tensor]], stats: PushStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor whole, detached, contiguous and on the CPU, one at a time: a DTensor
    gathered (`full_tensor`, a collective: every rank iterates the same tensors in the
    same order). The caller drops each before asking for the next; `stats` measures it."""
    stats = stats if stats is not None else PushStats()
    stats.tensors = stats.total_bytes = stats.peak_bytes = 0
    alive: list[weakref.ref] = []  # the gathered tensors handed out so far
    for name, tensor in named:
        gathered = isinstance(tensor, DTensor)
        whole = tensor.full_tensor() if gathered else tensor
        whole = whole.detach().contiguous().cpu()
        size = whole.numel() * whole.element_size()
        stats.tensors += 1
        stats.total_bytes += size
        if gathered:
            alive = [ref for ref in alive if ref() is not None]
            held = sum(ref().numel() * ref().element_size() for ref in alive)  # type: ignore[union-attr]
            stats.peak_bytes = max(stats.peak_bytes, held + size)
            alive.append(weakref.ref(whole))
        yield name, whole
        del whole


def save_in_turn(
    path: Path,
    named: Iterable[tuple[str, torch.Tensor]],
    stats: PushStats | None = None,
) -> None:
    """`named`'s tensors as one safetensors file at `path`, each made whole in turn
    (`whole_in_turn`) and written, then freed (module doc). The names must be distinct."""
    named = list(named)
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in named:
        if name in header:
            raise EngineError(f"weight push: the name {name} comes twice")
        if tensor.dtype not in DTYPES:
            raise EngineError(
                f"weight push: {name} has dtype {tensor.dtype}, which a safetensors file "
                "cannot hold; load the model as float32, bfloat16 or float16 (model.dtype)"
            )
        size = tensor.numel() * tensor.element_size()  # a DTensor's whole size
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name, whole in whole_in_turn(named, stats):
            if list(whole.shape) != header[name]["shape"]:
                raise EngineError(f"weight push: {name} gathered as {tuple(whole.shape)}")
            out.write(whole.reshape(-1).view(torch.uint8).numpy().data)
            del whole


def save_adapter_in_turn(model: Any, folder: Path, stats: PushStats | None = None) -> None:
    """A PEFT model's active LoRA adapter as the folder `save_pretrained` writes (its
    config and `adapter_model.safetensors`, under PEFT's names), each adapter tensor
    made whole in turn (`save_in_turn`): what vLLM's runtime LoRA loading reads."""
    from peft.utils import get_peft_model_state_dict

    adapter = model.active_adapter
    params = {name: p for name, p in model.named_parameters() if "lora_" in name}
    named = get_peft_model_state_dict(
        model, state_dict=params, adapter_name=adapter, save_embedding_layers=False
    )
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.peft_config[adapter])
    config.inference_mode = True
    config.save_pretrained(str(folder))
    save_in_turn(folder / "adapter_model.safetensors", named.items(), stats)
