"""The hf engine's decode step at fixed shapes, compiled (`rollout.compile`).

Eager decoding hands attention a view of the filled columns of each layer's KV buffer
(forward/kv.py `BufferLayer`): one column wider at every step, so a compiled graph would
be traced again at every step (`torch.compile(model, dynamic=True)` spent 288 s compiling
and then ran slower; docs/performance.md). Here the step's inputs keep one shape for as
long as the running batch keeps its rows: the new token ids [C, 1], their positions, the
column they are written to (a tensor, not a Python int), the attention mask over the
whole buffer [C, 1, 1, capacity] and the buffers themselves. The new keys and values are
written in place at that column (`FixedColumns`) and attention reads every column; the
mask hides the ones not filled yet. The first graph has static shapes; the first merge
that changes the rows or the columns compiles a second one in which those sizes are
symbolic (torch.compile's automatic dynamic shapes), which serves every later shape.
Capacities are rounded up to `COLUMN_MULTIPLE` columns, so that a CUDA graph, recorded
per concrete shape, is recorded for fewer of them.

On CUDA the graph is captured as CUDA graphs (`mode="reduce-overhead"`): the step's
hundreds of kernel launches replayed as one. The KV buffers are marked static inputs
(a graph may write them in place; a merge's new buffers make it be recorded again, not
compiled again) and the logits are copied out of the graph's output. Not run here (no
GPU): bench/checks/gpu_yardstick.py measures it, and counts graphs that ran uncaptured.

On the CPU it is inductor's code, which ran at 0.45-0.74x the eager engine in our
measurement (docs/performance.md), so `auto` leaves it off there.

Not compiled (the eager step runs): a step of k > 1 tokens (jump-forward), a cache that
is not plain buffers (sliding windows, linear attention), and a batch with a cascade
prefix (forward/cascade.py): inductor gave wrong logits when the cascade attention was
traced in one graph with the model (torch 2.13, CPU), so a batch that shares a prompt
head decodes eagerly.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from looprl.forward.kv import BufferLayer, Part

MODES = ("off", "auto", "on")
COLUMN_MULTIPLE = 64  # a batch's KV columns rounded up to this, so that merges share graphs
GRAPHS_KEPT = 64  # graphs compiled before a new shape decodes eagerly (torch's default: 8)


class FixedColumns(DynamicLayer):
    """One layer's whole [C, H, capacity, D] key and value buffers: `update` writes the
    new column at `column_1` in place and returns the buffers, every column (the
    attention mask hides those not filled yet), so shapes do not change between steps."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column_1: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.column_1 = keys, values, column_1
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.column_1, key_states)
        self.values.index_copy_(2, self.column_1, value_states)
        return self.keys, self.values


def decode_step(
    model: Any,
    tokens_C1: torch.Tensor,
    positions_C1: torch.Tensor,
    column_1: torch.Tensor,
    mask_C11L: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    """One decode step over fixed-shape inputs: the logits after the new token [C, V]
    (float32); the new keys and values land in `keys`/`values` at `column_1`."""
    cache = DynamicCache()
    cache.layers = [FixedColumns(k, v, column_1) for k, v in zip(keys, values)]
    out = model(
        input_ids=tokens_C1,
        attention_mask=mask_C11L,  # 4-D: transformers uses it as given
        position_ids=positions_C1,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


class CompiledStep:
    """The engine's compiled decode step: `applies` says whether a step can take it,
    `run` takes it. `shapes` counts the (rows, columns) it has met, `compile_seconds`
    sums the first call at each (where compiling, or capturing, happens)."""

    def __init__(self, mode: str, device: torch.device) -> None:
        if mode not in MODES:
            raise ValueError(f"compile mode {mode!r}: use one of {', '.join(MODES)}")
        self.on = mode == "on" or (mode == "auto" and device.type == "cuda")
        # CUDA graphs replay the whole step as one launch; inductor's kernels on the CPU
        self.cuda_graphs = self.on and device.type == "cuda"
        options = {"mode": "reduce-overhead"} if self.cuda_graphs else {}
        # static shapes first; a second shape (rows left or joined) compiles once more,
        # with the sizes that changed dynamic (torch.compile's automatic dynamic shapes)
        self._step = torch.compile(decode_step, **options) if self.on else None
        self.compile_seconds, self.shapes = 0.0, 0
        self._seen: set[tuple[int, int]] = set()

    @property
    def column_multiple(self) -> int:
        """What a running batch's KV columns are rounded up to (1: no rounding)."""
        return COLUMN_MULTIPLE if self.on else 1

    def applies(self, running: Part, k: int) -> bool:
        """Whether this step of k tokens can run compiled (see the module doc)."""
        if self._step is None or k != 1 or running.prefix is not None:
            return False
        layers = getattr(running.cache, "layers", None) or []
        return bool(layers) and all(type(layer) is BufferLayer for layer in layers)

    def run(self, model: Any, running: Part, tokens_C1: torch.Tensor) -> torch.Tensor:
        """Append one token to every row of `running` (its attention mask already marks
        the new column) and return the logits after it [C, V]."""
        layers = running.cache.layers
        width, capacity = running.width, layers[0].buffer_keys.shape[2]
        columns = running.attention_CL.shape[1]
        if width >= capacity or columns != capacity or layers[0].length != width:
            raise RuntimeError(
                f"compiled decode step: column {width} of a {capacity}-column KV buffer "
                f"holding {layers[0].length} (attention mask: {columns} columns); the "
                "batch was merged without room for its tokens, or out of step with its cache"
            )
        device = running.attention_CL.device
        shape = (len(running.attention_CL), capacity)
        if self.cuda_graphs:
            _static_buffers(layers)
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are used up
        start = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=GRAPHS_KEPT):
            logits_CV = self._step(
                model,
                tokens_C1.to(device),
                running.next_pos_C[:, None],
                torch.tensor([width], device=device),
                running.attention_CL.bool()[:, None, None, :],
                [layer.buffer_keys for layer in layers],
                [layer.buffer_values for layer in layers],
            )
        if shape not in self._seen:  # compiled (or captured) here, if anywhere
            self._seen.add(shape)
            self.shapes += 1
            self.compile_seconds += time.perf_counter() - start
        for layer in layers:  # the eager view of the filled columns, one wider
            layer.length += 1
            layer._sync()
        # a CUDA graph's outputs are overwritten by its next replay: the batch keeps a copy
        return logits_CV.clone() if self.cuda_graphs else logits_CV


def _static_buffers(layers: list[BufferLayer]) -> None:
    """Mark the KV buffers as static inputs of the CUDA graphs, which may then write
    them in place (a graph skips capture for a mutated input that is not static). No
    guard: a merge's new buffers make the graph be recorded again, not compiled again."""
    for layer in layers:
        for buffer in (layer.buffer_keys, layer.buffer_values):
            if not hasattr(buffer, "_dynamo_static_input_type"):
                torch._dynamo.mark_static_address(buffer, guard=False)
