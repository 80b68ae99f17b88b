"""Memory a run does not need to hold: freed heap pages given back to the operating
system between phases (`release_free_memory`), and activations recomputed in the
backward pass instead of kept from the forward (`checkpoint_layers`).

A rollout allocates its KV cache as many ~15 MB tensors, an update its activations;
glibc keeps such freed blocks in its heap (its mmap threshold rises with the first large
free), so without a trim the resident set only ever grows: each phase's peak stacks on
the previous phase's leftovers. `malloc_trim(0)` returns every free page; it takes a few
milliseconds and is a no-op where glibc is not the allocator.

Activation checkpointing keeps each decoder layer's input and recomputes the layer's
inside (norms, projections, attention, MLP: about 20 activations of the hidden or MLP
width per token) when the backward pass needs them. transformers' own switch
(`gradient_checkpointing_enable`) drops the KV cache of a model training under it, and
with it the trainer's shared-prompt forward (forward/score.py falls back to whole
sequences). `checkpoint_layers` keeps the cache: a layer's recomputation sees the cache
as it was before the layer wrote to it, and the cache is put back as it was after, so
the recomputed activations are the forward's own, bit for bit (same operations, same
shapes, on the same inputs), and so are the loss and the gradients.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import types
from functools import cache
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

CHECKPOINTED = "_looprl_checkpointed"  # set on each layer `checkpoint_layers` wrapped


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


def fix_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Serve every block over `nbytes` with a mapping of its own, given back to the
    system when freed, and keep that threshold fixed (setting it turns off glibc's
    raising it to the largest block freed, up to 32 MB). A sharded rank gathers whole
    weights for a phase and frees them, then gathers a layer at a time: under the raised
    threshold those frees stayed in the heap, where blocks of other sizes fit badly, and
    its peak rose about 1 GB above what it holds (bench/speed/shard.py). False where
    glibc is not the allocator."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))


def checkpoint_layers(model: Any) -> int:
    """Recompute each decoder layer of `model` in the backward pass (whenever the model is
    in training mode with gradients enabled; sampling and no-grad scoring run the layers
    as they are). Returns how many layers were wrapped: 0 for a model whose layers are not
    transformers' `GradientCheckpointingLayer`s (remote code of another shape)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    wrapped = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and not hasattr(module, CHECKPOINTED):
            # a bound method, not a closure: a deepcopy of the model (loop/snapshot.py)
            # gets its own layers' methods bound to the copies
            module.forward = types.MethodType(_checkpointed_forward, module)
            setattr(module, CHECKPOINTED, True)
            wrapped += 1
    return wrapped


def _checkpointed_forward(layer: Any, *args: Any, **kwargs: Any) -> Any:
    forward = type(layer).forward
    if not (layer.training and torch.is_grad_enabled()):
        return forward(layer, *args, **kwargs)
    cache_ = kwargs.get("cache", kwargs.get("past_key_values"))
    before = _cache_state(cache_)
    recomputing = False

    def run(*inputs: Any) -> Any:
        nonlocal recomputing
        if not recomputing:  # the forward pass itself
            recomputing = True
            return forward(layer, *inputs, **kwargs)
        # the backward pass's recomputation: the cache as this layer found it, so that it
        # writes (and reads) the same keys and values again; then as the forward left it
        after = _cache_state(cache_)
        _restore(before)
        try:
            return forward(layer, *inputs, **kwargs)
        finally:  # also when autograd stops the recomputation early
            _restore(after)

    return checkpoint(run, *args, use_reentrant=False)


def _cache_state(cache_: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The attributes of a cache and of its layers now (a shallow copy, lists copied: the
    tensors themselves are shared, and transformers' layers replace them rather than
    write into them; a layer the cache adds lazily is appended to its list)."""
    if cache_ is None:
        return []
    objects = [cache_, *getattr(cache_, "layers", [])]
    return [
        (obj, {k: list(v) if isinstance(v, list) else v for k, v in vars(obj).items()})
        for obj in objects
    ]


def _restore(state: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, attributes in state:
        vars(obj).clear()
        vars(obj).update(attributes)
